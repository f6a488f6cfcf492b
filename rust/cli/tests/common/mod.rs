//! What every CLI integration test needs: the built `dart-ngram` and a way to run it.

use std::process::Command;

/// The `dart-ngram` binary cargo built for these tests.
#[allow(dead_code)] // not every test file spawns it by hand
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_dart-ngram"))
}

/// Run `dart-ngram ARGS`: (success, stdout, stderr).
#[allow(dead_code)]
pub fn run(args: &[&str]) -> (bool, String, String) {
    let out = bin().args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
