//! Loading a `tokenizer.json` with the `tokenizers` crate: encoding, vocabulary size,
//! fingerprint and the end-of-document token.

use std::path::{Path, PathBuf};

use dart_ngram::error::{NGramError, Result};
use dart_ngram::fingerprint;
use tokenizers::Tokenizer;

use crate::bytelevel::{ByteLevelEncoder, ByteLevelPlan};

/// A loaded tokenizer and what the build needs to know about it.
pub struct LoadedTokenizer {
    path: PathBuf,
    tokenizer: Tokenizer,
    vocab_size: u32,
    fingerprint: [u8; 32],
    /// The fast path, for byte-level BPE tokenizers (see [`crate::bytelevel`]).
    bytelevel: Option<ByteLevelPlan>,
}

/// One thread's encoder: [`LoadedTokenizer::encoder`].
pub struct Encoder<'a> {
    tok: &'a LoadedTokenizer,
    fast: Option<ByteLevelEncoder<'a>>,
}

impl Encoder<'_> {
    /// Appends the ids of `text`: exactly [`LoadedTokenizer::encode`]'s, faster for byte-level
    /// BPE tokenizers (a per-encoder word cache; see [`crate::bytelevel`]).
    pub fn encode_into(&mut self, text: &str, out: &mut Vec<u32>) -> Result<()> {
        match &mut self.fast {
            Some(f) => f
                .encode_into(text, out)
                .map_err(|e| self.tok.encode_error(e)),
            None => {
                out.extend_from_slice(&self.tok.encode(text)?);
                Ok(())
            }
        }
    }
}

impl LoadedTokenizer {
    /// Loads `tokenizer.json` (a directory holding one is accepted too).
    pub fn load(path: &Path) -> Result<Self> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        if !file.is_file() {
            return Err(NGramError::Tokenizer {
                path: file,
                detail: "no such file; expected a Hugging Face tokenizer.json".into(),
            });
        }
        let tokenizer = Tokenizer::from_file(&file).map_err(|e| NGramError::Tokenizer {
            path: file.clone(),
            detail: format!("cannot load it with the tokenizers library: {e}"),
        })?;
        let vocab = tokenizer.get_vocab(true);
        let max_id = vocab
            .values()
            .copied()
            .max()
            .ok_or_else(|| NGramError::Tokenizer {
                path: file.clone(),
                detail: "the vocabulary is empty".into(),
            })?;
        let fp = fingerprint::fingerprint_from_pairs(vocab.iter().map(|(t, &id)| (t.as_str(), id)))
            .map_err(|e| NGramError::Tokenizer {
                path: file.clone(),
                detail: e.to_string(),
            })?;
        let bytelevel = ByteLevelPlan::from_tokenizer(&tokenizer);
        Ok(LoadedTokenizer {
            path: file,
            tokenizer,
            vocab_size: max_id + 1,
            fingerprint: fp,
            bytelevel,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Highest token id (added tokens included) plus one.
    pub fn vocab_size(&self) -> u32 {
        self.vocab_size
    }

    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.token_to_id(token)
    }

    /// Token ids of `text` with the special tokens the tokenizer adds itself
    /// (`add_special_tokens = true`, as the reference counts), by the `tokenizers` crate's own
    /// pipeline. Bulk work should use an [`Encoder`] (same ids, faster).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, true)
    }

    /// Token ids of `text` alone, no special tokens added (a query's context, a candidate).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_with(text, false)
    }

    fn encode_with(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        // encode_fast skips character offsets, which counting never needs.
        let enc = self
            .tokenizer
            .encode_fast(text, add_special_tokens)
            .map_err(|e| self.encode_error(e))?;
        Ok(enc.get_ids().to_vec())
    }

    /// How token `id` reads: its decoded text (byte-level marks undone), or the raw token
    /// when it does not decode to text on its own (part of a UTF-8 character), or `<id?>`.
    pub fn decode_token(&self, id: u32) -> String {
        match self.tokenizer.decode(&[id], false) {
            Ok(text) if !text.contains('\u{fffd}') => text,
            _ => self
                .tokenizer
                .id_to_token(id)
                .unwrap_or_else(|| format!("<{id}?>")),
        }
    }

    fn encode_error(&self, e: tokenizers::Error) -> NGramError {
        NGramError::Tokenizer {
            path: self.path.clone(),
            detail: format!("encoding failed: {e}"),
        }
    }

    /// An encoder for one thread (it keeps a cache of the words it has seen).
    pub fn encoder(&self) -> Encoder<'_> {
        Encoder {
            tok: self,
            fast: self
                .bytelevel
                .as_ref()
                .map(|p| ByteLevelEncoder::new(p, &self.tokenizer)),
        }
    }

    /// Whether [`Self::encoder`] takes the byte-level BPE fast path.
    pub fn has_fast_path(&self) -> bool {
        self.bytelevel.is_some()
    }

    /// The `eos_token` of the `tokenizer_config.json` beside `tokenizer.json`, if there is
    /// such a file and it names one. The token must exist in the vocabulary.
    pub fn eos_from_config(&self) -> Result<Option<u32>> {
        let config = self
            .path
            .parent()
            .unwrap_or(Path::new("."))
            .join("tokenizer_config.json");
        let text = match std::fs::read_to_string(&config) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(NGramError::io(&config, e)),
        };
        let bad = |detail: String| NGramError::Tokenizer {
            path: config.clone(),
            detail,
        };
        let value: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        // `eos_token` is either the token string or an AddedToken object with `content`.
        let token = match value.get("eos_token") {
            None | Some(serde_json::Value::Null) => return Ok(None),
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(obj @ serde_json::Value::Object(_)) => match obj.get("content") {
                Some(serde_json::Value::String(s)) => s.clone(),
                _ => {
                    return Err(bad(format!(
                        "eos_token {obj} has no string \"content\"; expected a token string"
                    )))
                }
            },
            Some(other) => {
                return Err(bad(format!("eos_token {other} is not a token string")));
            }
        };
        match self.token_to_id(&token) {
            Some(id) => Ok(Some(id)),
            None => Err(bad(format!(
                "eos_token {token:?} is not in the vocabulary of {}",
                self.path.display()
            ))),
        }
    }
}

/// How the end-of-document token is chosen.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum EosChoice {
    /// `tokenizer_config.json` beside the tokenizer; an error if there is none.
    #[default]
    Auto,
    Id(u32),
    /// A token string looked up in the tokenizer's vocabulary.
    Token(String),
    /// Documents get no end token (`--no-eos`).
    NoEos,
}

/// Resolves the end-of-document token; `None` only for [`EosChoice::NoEos`].
pub fn resolve_eos(
    choice: &EosChoice,
    tokenizer: Option<&LoadedTokenizer>,
    vocab_size: u32,
) -> Result<Option<u32>> {
    let id = match (choice, tokenizer) {
        (EosChoice::NoEos, _) => return Ok(None),
        (EosChoice::Id(id), _) => *id,
        (EosChoice::Token(t), Some(tok)) => {
            tok.token_to_id(t).ok_or_else(|| NGramError::Tokenizer {
                path: tok.path().to_path_buf(),
                detail: format!(
                    "the end-of-document token {t:?} (--eos-token) is not in the vocabulary"
                ),
            })?
        }
        (EosChoice::Token(t), None) => {
            return Err(NGramError::InvalidArgument(format!(
                "--eos-token {t:?} needs --tokenizer to look it up; give --eos-id instead"
            )))
        }
        (EosChoice::Auto, Some(tok)) => {
            tok.eos_from_config()?
                .ok_or_else(|| NGramError::Tokenizer {
                    path: tok.path().to_path_buf(),
                    detail: "no end-of-document token: tokenizer_config.json beside it names no \
                     eos_token; give --eos-id N, --eos-token S or --no-eos"
                        .into(),
                })?
        }
        (EosChoice::Auto, None) => {
            return Err(NGramError::InvalidArgument(
                "no end-of-document token: without --tokenizer, give --eos-id N or --no-eos".into(),
            ))
        }
    };
    if id >= vocab_size {
        return Err(NGramError::InvalidArgument(format!(
            "end-of-document token id {id} is outside the vocabulary (size {vocab_size})"
        )));
    }
    Ok(Some(id))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A small real tokenizer.json (word-level model, whitespace pre-tokenizer, a template
    /// that prepends `<s>`), written by hand so tests need no download.
    pub(crate) fn write_word_tokenizer(dir: &Path, eos_in_config: Option<&str>) -> PathBuf {
        let words = [
            "<unk>", "<s>", "</s>", "the", "cat", "sat", "on", "mat", "a", "dog", ".",
        ];
        let vocab: serde_json::Map<String, serde_json::Value> = words
            .iter()
            .enumerate()
            .map(|(i, w)| (w.to_string(), serde_json::Value::from(i)))
            .collect();
        let json = serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [
                {"id": 1, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 2, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 11, "content": "<extra>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "Whitespace"},
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}
            },
            "decoder": null,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
        });
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
        if let Some(eos) = eos_in_config {
            std::fs::write(
                dir.join("tokenizer_config.json"),
                serde_json::to_vec(&serde_json::json!({"eos_token": eos})).unwrap(),
            )
            .unwrap();
        }
        path
    }

    #[test]
    fn loads_encodes_and_fingerprints() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_word_tokenizer(dir.path(), Some("</s>"));
        let tok = LoadedTokenizer::load(&path).unwrap();
        assert_eq!(tok.vocab_size(), 12, "max id (added <extra> = 11) + 1");
        assert_eq!(tok.encode("the cat sat").unwrap(), vec![1, 3, 4, 5]);
        assert_eq!(tok.encode("a zebra").unwrap(), vec![1, 8, 0]);
        let words = [
            "<unk>", "<s>", "</s>", "the", "cat", "sat", "on", "mat", "a", "dog", ".", "<extra>",
        ];
        assert_eq!(
            tok.fingerprint(),
            fingerprint::fingerprint_from_vocab(words.into_iter())
        );
        assert_eq!(tok.eos_from_config().unwrap(), Some(2));
        // A directory holding tokenizer.json works too.
        assert_eq!(LoadedTokenizer::load(dir.path()).unwrap().vocab_size(), 12);
    }

    #[test]
    fn eos_resolution() {
        let dir = tempfile::tempdir().unwrap();
        let path = write_word_tokenizer(dir.path(), None);
        let tok = LoadedTokenizer::load(&path).unwrap();
        let err = resolve_eos(&EosChoice::Auto, Some(&tok), 12).unwrap_err();
        assert!(err.to_string().contains("--eos-id"), "{err}");
        assert_eq!(
            resolve_eos(&EosChoice::Token("</s>".into()), Some(&tok), 12).unwrap(),
            Some(2)
        );
        assert!(resolve_eos(&EosChoice::Token("nope".into()), Some(&tok), 12).is_err());
        assert_eq!(resolve_eos(&EosChoice::Id(7), None, 12).unwrap(), Some(7));
        assert!(resolve_eos(&EosChoice::Id(12), None, 12).is_err());
        assert!(resolve_eos(&EosChoice::Auto, None, 12).is_err());
        assert_eq!(resolve_eos(&EosChoice::NoEos, None, 12).unwrap(), None);

        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"eos_token": {"content": "</s>"}}"#,
        )
        .unwrap();
        assert_eq!(tok.eos_from_config().unwrap(), Some(2));
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            r#"{"eos_token": "<zzz>"}"#,
        )
        .unwrap();
        let err = tok.eos_from_config().unwrap_err();
        assert!(err.to_string().contains("<zzz>"), "{err}");
        std::fs::write(dir.path().join("tokenizer_config.json"), "{oops").unwrap();
        assert!(tok.eos_from_config().is_err());
    }

    #[test]
    fn missing_or_broken_tokenizer() {
        let dir = tempfile::tempdir().unwrap();
        let err = LoadedTokenizer::load(&dir.path().join("nope.json"))
            .err()
            .unwrap();
        assert!(err.to_string().contains("nope.json"), "{err}");
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "{\"model\": 3}").unwrap();
        let err = LoadedTokenizer::load(&bad).err().unwrap();
        assert!(err.to_string().contains("bad.json"), "{err}");
    }
}
