//! `dart-ngram query MODEL --context A B (--candidates C D E | --top K) [--json]`.

use std::path::PathBuf;

use dart_ngram::NGramModel;

#[derive(clap::Args)]
pub struct Args {
    /// The model file.
    pub model: PathBuf,
    /// Context token ids (only the last order-1 are used).
    #[arg(long, num_args = 0.., required = true)]
    pub context: Vec<u32>,
    /// Candidate next tokens: prints their probabilities and matched context lengths.
    #[arg(long, num_args = 1.., conflicts_with = "top", required_unless_present = "top")]
    pub candidates: Vec<u32>,
    /// Print the K most likely continuations instead.
    #[arg(long)]
    pub top: Option<usize>,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let m = NGramModel::open(&args.model)?;
    if let Some(k) = args.top {
        let top = m.top_k(&args.context, k)?;
        if args.json {
            let ids: Vec<u32> = top.iter().map(|x| x.0).collect();
            let probs: Vec<f32> = top.iter().map(|x| x.1).collect();
            println!("{}", serde_json::json!({ "ids": ids, "probs": probs }));
        } else {
            for (t, p) in top {
                println!("{t}\t{p}");
            }
        }
        return Ok(());
    }
    let n = args.candidates.len();
    let (mut probs, mut matched) = (vec![0f32; n], vec![0u8; n]);
    m.prob_many(&args.context, &args.candidates, &mut probs, &mut matched)?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({ "probs": probs, "matched": matched })
        );
    } else {
        for ((c, p), k) in args.candidates.iter().zip(&probs).zip(&matched) {
            println!("{c}\t{p}\tmatched {k}");
        }
    }
    Ok(())
}
