// Temporary (engineer A2): rewrite a model in the current format layout.
use dart_ngram::{merge_models, MergeOptions};
fn main() {
    let a: Vec<String> = std::env::args().collect();
    let opts = MergeOptions {
        allow_pruned: true,
        source: Some("converted".into()),
        ..Default::default()
    };
    let r = merge_models(&[a[1].as_ref()], a[2].as_ref(), &opts).unwrap();
    eprintln!("{r:?}");
}
