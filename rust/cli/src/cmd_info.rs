//! (being written)
#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> Result<(), Box<dyn std::error::Error>> {
    Err("not implemented yet".into())
}
