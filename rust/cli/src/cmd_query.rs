//! `dart-ngram query MODEL (--context IDS | --text TEXT) (--candidates ... | --top K)`.
//!
//! With `--tokenizer`, text goes in and every id comes out with its token beside it.

use std::path::PathBuf;

use dart_ngram::NGramModel;
use dart_ngram_build::tokenize::LoadedTokenizer;

#[derive(clap::Args)]
pub struct Args {
    /// The model file.
    pub model: PathBuf,
    /// Context token ids (only the last order-1 are used).
    #[arg(long, num_args = 0.., required_unless_present = "text", conflicts_with = "text")]
    pub context: Vec<u32>,
    /// Context as text, encoded with --tokenizer (no special tokens added).
    #[arg(long, requires = "tokenizer")]
    pub text: Option<String>,
    /// The model's `tokenizer.json` (or its directory): encodes --text and
    /// --candidate-tokens, and prints each id's token. Must be the tokenizer the model was
    /// built with.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Candidate next tokens by id: prints their probabilities and matched context lengths.
    #[arg(long, num_args = 1.., conflicts_with = "top")]
    pub candidates: Vec<u32>,
    /// Candidate next tokens as text, each exactly one token of --tokenizer (e.g. " the").
    #[arg(long, num_args = 1.., conflicts_with = "top", requires = "tokenizer")]
    pub candidate_tokens: Vec<String>,
    /// The K most likely continuations of the longest matched context: one distribution
    /// `count(s c) / count(s)`, which sums to at most 1.
    #[arg(long, required_unless_present_any = ["candidates", "candidate_tokens"])]
    pub top: Option<usize>,
    /// With --top: rank by DART's backoff scores instead (what the pruner uses: each token
    /// takes its probability from its own longest match, so the column is not one
    /// distribution), with each row's matched context length.
    #[arg(long, requires = "top")]
    pub backoff: bool,
    /// JSON output.
    #[arg(long)]
    pub json: bool,
}

/// Ids and, with a tokenizer, how each reads.
struct Vocab {
    tokenizer: Option<LoadedTokenizer>,
}

impl Vocab {
    fn show(&self, id: u32) -> Option<String> {
        self.tokenizer.as_ref().map(|t| t.decode_token(id))
    }

    fn column(&self, ids: &[u32]) -> Option<Vec<String>> {
        self.tokenizer
            .as_ref()
            .map(|t| ids.iter().map(|&i| t.decode_token(i)).collect())
    }

    fn one_token(&self, text: &str) -> Result<u32, String> {
        let t = self.tokenizer.as_ref().expect("clap requires --tokenizer");
        let ids = t.encode_plain(text).map_err(|e| e.to_string())?;
        match ids[..] {
            [id] => Ok(id),
            _ => Err(format!(
                "--candidate-tokens {text:?} is {} tokens ({ids:?}), not one",
                ids.len()
            )),
        }
    }
}

pub fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let m = NGramModel::open(&args.model)?;
    let vocab = Vocab {
        tokenizer: match &args.tokenizer {
            Some(path) => {
                let t = LoadedTokenizer::load(path)?;
                m.check_fingerprint(&t.fingerprint())?;
                Some(t)
            }
            None => None,
        },
    };
    let context = match &args.text {
        Some(text) => vocab
            .tokenizer
            .as_ref()
            .expect("clap requires --tokenizer")
            .encode_plain(text)?,
        None => args.context.clone(),
    };
    let used = &context[context.len().saturating_sub(m.order() - 1)..];
    if let Some(k) = args.top {
        return print_top(&m, &vocab, used, k, args.backoff, args.json);
    }
    let mut candidates = args.candidates.clone();
    for text in &args.candidate_tokens {
        candidates.push(vocab.one_token(text)?);
    }
    let n = candidates.len();
    let (mut probs, mut matched) = (vec![0f32; n], vec![0u8; n]);
    m.prob_many(used, &candidates, &mut probs, &mut matched)?;
    if args.json {
        let mut v = serde_json::json!({ "context": used, "ids": candidates, "probs": probs, "matched": matched });
        if let Some(tokens) = vocab.column(&candidates) {
            v["tokens"] = tokens.into();
        }
        println!("{v}");
    } else {
        print_context(&vocab, used);
        for ((&c, p), k) in candidates.iter().zip(&probs).zip(&matched) {
            println!("{}\t{p:.6}\tmatched {k}", label(&vocab, c));
        }
    }
    Ok(())
}

fn print_top(
    m: &NGramModel,
    vocab: &Vocab,
    context: &[u32],
    k: usize,
    backoff: bool,
    json: bool,
) -> Result<(), Box<dyn std::error::Error>> {
    let (rows, matched): (Vec<(u32, f32)>, Vec<u8>) = if backoff {
        let rows = m.top_k(context, k)?;
        let ids: Vec<u32> = rows.iter().map(|r| r.0).collect();
        let (mut p, mut matched) = (vec![0f32; ids.len()], vec![0u8; ids.len()]);
        m.prob_many(context, &ids, &mut p, &mut matched)?;
        (rows, matched)
    } else {
        let (len, rows) = m.continuations(context, k)?;
        let matched = vec![len as u8; rows.len()];
        (rows, matched)
    };
    let ids: Vec<u32> = rows.iter().map(|r| r.0).collect();
    let probs: Vec<f32> = rows.iter().map(|r| r.1).collect();
    if json {
        let mut v = serde_json::json!({
            "context": context,
            "scores": if backoff { "backoff" } else { "distribution" },
            "ids": ids,
            "probs": probs,
            "matched": matched,
        });
        if let Some(tokens) = vocab.column(&ids) {
            v["tokens"] = tokens.into();
        }
        println!("{v}");
        return Ok(());
    }
    print_context(vocab, context);
    if backoff {
        println!(
            "# DART backoff scores: each row from its own longest match (not one distribution)"
        );
        if rows.is_empty() {
            println!("# no continuation seen after any suffix of the context");
        }
        for ((t, p), k) in rows.iter().zip(&matched) {
            println!("{}\t{p:.6}\tmatched {k}", label(vocab, *t));
        }
    } else {
        let len = matched.first().copied().unwrap_or(0) as usize;
        let s = &context[context.len() - len..];
        println!(
            "# P(next | {}): order-{} distribution, top {} shown (sum {:.6})",
            if s.is_empty() {
                "nothing (unigrams)".to_string()
            } else {
                format!("{s:?}")
            },
            len + 1,
            rows.len(),
            probs.iter().map(|&p| f64::from(p)).sum::<f64>()
        );
        for (t, p) in &rows {
            println!("{}\t{p:.6}", label(vocab, *t));
        }
    }
    Ok(())
}

fn label(vocab: &Vocab, id: u32) -> String {
    match vocab.show(id) {
        Some(tok) => format!("{id}\t{tok:?}"),
        None => id.to_string(),
    }
}

fn print_context(vocab: &Vocab, context: &[u32]) {
    let shown: Vec<String> = context
        .iter()
        .map(|&t| label(vocab, t).replace('\t', " "))
        .collect();
    println!("# context (last order-1 tokens): [{}]", shown.join(", "));
}
