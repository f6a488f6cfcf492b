//! The fast path of tokenization for byte-level BPE tokenizers (GPT-2, SmolLM2, Llama-2-free
//! byte-level families): exactly the ids of the `tokenizers` crate's
//! `encode(text, add_special_tokens = true)`, computed without its per-character bookkeeping
//! (alignments, token strings, offsets) and with a per-thread cache from pre-tokenized word
//! to ids, so the BPE merges run once per distinct word instead of once per occurrence.
//!
//! [`ByteLevelPlan::from_tokenizer`] accepts a tokenizer only when every stage is one this
//! path reproduces exactly, and returns `None` otherwise (the caller then uses the crate's own
//! `encode`):
//!
//! * no normalizer, no truncation, no padding;
//! * added tokens without `single_word`, `lstrip` or `rstrip`, with distinct contents, and
//!   `encode_special_tokens` off. They are split out of the text as the crate does it: a
//!   leftmost-longest search for the non-normalized ones over the text, then for the
//!   normalized ones over the pieces between (the same patterns, as there is no normalizer);
//! * the pre-tokenizer is `ByteLevel` with `add_prefix_space = false`: each piece is split by
//!   the crate's own GPT-2 regex (the same `SysRegex` engine and pattern, matches and the gaps
//!   between them each a word), and each word's bytes are mapped to the byte-level alphabet;
//! * the model is BPE without dropout: each distinct word is tokenized once by the crate's own
//!   `BPE::tokenize` (a pure function of the word then) and its ids cached;
//! * the post-processor (whatever it is) only adds fixed ids before and after the sequence:
//!   checked at load by running it on sentinel encodings of one and two ids.

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use rustc_hash::FxHashMap;
use std::hash::Hasher;
use tokenizers::models::ModelWrapper;
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::utils::SysRegex;
use tokenizers::{Encoding, Model, Token, Tokenizer};

/// The GPT-2 pre-tokenization pattern, as the `tokenizers` crate's `ByteLevel` uses it.
const GPT2_PATTERN: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

/// The byte-level alphabet (GPT-2's `bytes_to_unicode`): printable Latin-1 bytes (`!`..=`~`,
/// `¡`..=`¬`, `®`..=`ÿ`) stand for themselves; the other 68 bytes, in increasing order, map
/// to U+0100, U+0101, ...
pub fn byte_chars() -> [char; 256] {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut out = ['\0'; 256];
    let mut next = 0x100u32;
    for b in 0..=255u8 {
        out[b as usize] = if printable(b) {
            char::from(b)
        } else {
            let c = char::from_u32(next).expect("U+0100..U+0143 are chars");
            next += 1;
            c
        };
    }
    out
}

/// What the fast path needs, derived once from a tokenizer.
pub struct ByteLevelPlan {
    /// Added-token searches, applied in turn (non-normalized, then normalized), each with the
    /// id of every pattern.
    added: Vec<(AhoCorasick, Vec<u32>)>,
    regex: SysRegex,
    byte_chars: [char; 256],
    /// Ids the post-processor puts before and after the sequence.
    prefix: Vec<u32>,
    suffix: Vec<u32>,
}

impl ByteLevelPlan {
    /// The plan for `tok`, or `None` if some stage is not one this path reproduces exactly.
    pub fn from_tokenizer(tok: &Tokenizer) -> Option<Self> {
        if tok.get_normalizer().is_some()
            || tok.get_truncation().is_some()
            || tok.get_padding().is_some()
            || tok.get_encode_special_tokens()
        {
            return None;
        }
        match tok.get_pre_tokenizer() {
            Some(PreTokenizerWrapper::ByteLevel(b)) if !b.add_prefix_space && b.use_regex => {}
            _ => return None,
        }
        match tok.get_model() {
            ModelWrapper::BPE(bpe) if bpe.dropout.is_none_or(|d| d == 0.0) => {}
            _ => return None,
        }
        let mut tokens: Vec<(u32, tokenizers::AddedToken)> =
            tok.get_added_tokens_decoder().into_iter().collect();
        tokens.sort_by_key(|(id, _)| *id);
        let mut contents: Vec<&str> = tokens.iter().map(|(_, t)| t.content.as_str()).collect();
        contents.sort_unstable();
        if contents.windows(2).any(|w| w[0] == w[1])
            || tokens
                .iter()
                .any(|(_, t)| t.single_word || t.lstrip || t.rstrip || t.content.is_empty())
        {
            return None;
        }
        let mut added = Vec::new();
        for normalized in [false, true] {
            let (pats, ids): (Vec<&str>, Vec<u32>) = tokens
                .iter()
                .filter(|(_, t)| t.normalized == normalized)
                .map(|(id, t)| (t.content.as_str(), *id))
                .unzip();
            if pats.is_empty() {
                continue;
            }
            let ac = AhoCorasickBuilder::new()
                .match_kind(MatchKind::LeftmostLongest)
                .build(&pats)
                .ok()?;
            added.push((ac, ids));
        }
        let (prefix, suffix) = fixed_specials(tok)?;
        Some(ByteLevelPlan {
            added,
            regex: SysRegex::new(GPT2_PATTERN).ok()?,
            byte_chars: byte_chars(),
            prefix,
            suffix,
        })
    }
}

/// The ids the post-processor adds around a single sequence with `add_special_tokens`, if it
/// adds the same ones whatever the sequence (checked on sentinel sequences of one and two ids).
fn fixed_specials(tok: &Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    const S: [u32; 2] = [u32::MAX - 1, u32::MAX - 2];
    let run = |ids: &[u32]| -> Option<Vec<u32>> {
        let tokens = ids
            .iter()
            .map(|&id| Token::new(id, String::new(), (0, 0)))
            .collect();
        let enc = tok
            .post_process(Encoding::from_tokens(tokens, 0), None, true)
            .ok()?;
        Some(enc.get_ids().to_vec())
    };
    let one = run(&S[..1])?;
    let at = one.iter().position(|&i| i == S[0])?;
    let (prefix, suffix) = (one[..at].to_vec(), one[at + 1..].to_vec());
    let two = run(&S)?;
    let expect: Vec<u32> = prefix.iter().chain(&S).chain(&suffix).copied().collect();
    (two == expect && !prefix.contains(&S[0]) && !suffix.contains(&S[0]))
        .then_some((prefix, suffix))
}

/// Bytes a word cache may hold (keys, ids and index) per encoder.
pub const CACHE_BYTES: usize = 24 << 20;

/// Index and arena bytes per cached word, beside its key and ids.
const ENTRY_OVERHEAD: usize = 40;

/// Word bytes -> ids, for words seen before, in one arena. Lookups hash the word and compare
/// its bytes with the stored key, so a hash collision is a miss, never a wrong answer. Stops
/// taking words once it holds [`CACHE_BYTES`].
struct WordCache {
    index: FxHashMap<u64, u32>,
    /// Per word: key start, key length, ids start, ids length.
    entries: Vec<[u32; 4]>,
    keys: Vec<u8>,
    ids: Vec<u32>,
    limit: usize,
}

impl WordCache {
    fn new(limit: usize) -> Self {
        WordCache {
            index: FxHashMap::default(),
            entries: Vec::new(),
            keys: Vec::new(),
            ids: Vec::new(),
            limit,
        }
    }

    fn hash(word: &[u8]) -> u64 {
        let mut h = rustc_hash::FxHasher::default();
        h.write(word);
        h.finish()
    }

    #[inline]
    fn get(&self, hash: u64, word: &[u8]) -> Option<&[u32]> {
        let &e = self.index.get(&hash)?;
        let [k, kl, i, il] = self.entries[e as usize];
        let key = &self.keys[k as usize..(k + kl) as usize];
        (key == word).then(|| &self.ids[i as usize..(i + il) as usize])
    }

    fn insert(&mut self, hash: u64, word: &[u8], ids: &[u32]) {
        let used = self.keys.len() + 4 * self.ids.len() + ENTRY_OVERHEAD * self.entries.len();
        if used + word.len() + 4 * ids.len() + ENTRY_OVERHEAD > self.limit
            || self.index.contains_key(&hash)
        {
            return;
        }
        let e = [
            self.keys.len() as u32,
            word.len() as u32,
            self.ids.len() as u32,
            ids.len() as u32,
        ];
        self.keys.extend_from_slice(word);
        self.ids.extend_from_slice(ids);
        self.index.insert(hash, self.entries.len() as u32);
        self.entries.push(e);
    }
}

/// One thread's encoder over a [`ByteLevelPlan`].
pub struct ByteLevelEncoder<'a> {
    plan: &'a ByteLevelPlan,
    tok: &'a Tokenizer,
    cache: WordCache,
    mapped: String,
}

impl<'a> ByteLevelEncoder<'a> {
    pub fn new(plan: &'a ByteLevelPlan, tok: &'a Tokenizer) -> Self {
        Self::with_cache(plan, tok, CACHE_BYTES)
    }

    fn with_cache(plan: &'a ByteLevelPlan, tok: &'a Tokenizer, limit: usize) -> Self {
        ByteLevelEncoder {
            plan,
            tok,
            cache: WordCache::new(limit),
            mapped: String::new(),
        }
    }

    /// Appends the ids of `text` (special tokens added, as `encode(text, true)`).
    pub fn encode_into(&mut self, text: &str, out: &mut Vec<u32>) -> tokenizers::Result<()> {
        out.extend_from_slice(&self.plan.prefix);
        self.added(text, 0, out)?;
        out.extend_from_slice(&self.plan.suffix);
        Ok(())
    }

    /// Splits out the added tokens of search `level` (and the later ones), then the words.
    fn added(&mut self, text: &str, level: usize, out: &mut Vec<u32>) -> tokenizers::Result<()> {
        let plan = self.plan;
        let Some((ac, ids)) = plan.added.get(level) else {
            return self.words(text, out);
        };
        let mut prev = 0;
        for m in ac.find_iter(text) {
            if m.start() > prev {
                self.added(&text[prev..m.start()], level + 1, out)?;
            }
            out.push(ids[m.pattern().as_usize()]);
            prev = m.end();
        }
        if prev < text.len() {
            self.added(&text[prev..], level + 1, out)?;
        }
        Ok(())
    }

    /// The ids of a piece without added tokens: each regex match, and each gap between
    /// matches, is a word.
    fn words(&mut self, text: &str, out: &mut Vec<u32>) -> tokenizers::Result<()> {
        let mut prev = 0;
        for (start, end) in self.plan.regex.find_iter(text) {
            if start > prev {
                self.word(&text[prev..start], out)?;
            }
            self.word(&text[start..end], out)?;
            prev = end;
        }
        if prev < text.len() {
            self.word(&text[prev..], out)?;
        }
        Ok(())
    }

    #[inline]
    fn word(&mut self, word: &str, out: &mut Vec<u32>) -> tokenizers::Result<()> {
        let bytes = word.as_bytes();
        if bytes.is_empty() {
            return Ok(());
        }
        let hash = WordCache::hash(bytes);
        if let Some(ids) = self.cache.get(hash, bytes) {
            out.extend_from_slice(ids);
            return Ok(());
        }
        self.mapped.clear();
        self.mapped
            .extend(bytes.iter().map(|&b| self.plan.byte_chars[b as usize]));
        let start = out.len();
        out.extend(
            self.tok
                .get_model()
                .tokenize(&self.mapped)?
                .into_iter()
                .map(|t| t.id),
        );
        self.cache.insert(hash, bytes, &out[start..]);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A small byte-level BPE tokenizer.json in the shape of GPT-2/SmolLM2's: the 256 byte
    /// characters, a few merges (words, digits, spaces, newlines), added special tokens (one
    /// normalized) and a post-processor adding `<s>` before each sequence.
    pub(crate) fn write_bytelevel_tokenizer(dir: &std::path::Path, template: bool) -> String {
        let chars = byte_chars();
        let mut vocab: Vec<String> = chars.iter().map(|c| c.to_string()).collect();
        let sp = chars[b' ' as usize];
        let nl = chars[b'\n' as usize];
        let merges: Vec<(String, String)> = [
            ("t", "h"),
            ("th", "e"),
            (&sp.to_string(), "the"),
            ("c", "a"),
            ("ca", "t"),
            (&sp.to_string(), "cat"),
            ("1", "2"),
            (&sp.to_string(), &sp.to_string()),
            (&nl.to_string(), &nl.to_string()),
            ("é", "t"),
            (&format!("{}{}", chars[0xC3], chars[0xA9]), "t"),
            (&chars[0xC3].to_string(), &chars[0xA9].to_string()),
        ]
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
        for (a, b) in &merges {
            let m = format!("{a}{b}");
            if !vocab.contains(&m) {
                vocab.push(m);
            }
        }
        let specials = ["<|endoftext|>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"];
        let base = vocab.len();
        let vocab_json: serde_json::Map<String, serde_json::Value> = vocab
            .iter()
            .enumerate()
            .map(|(i, w)| (w.clone(), serde_json::Value::from(i)))
            .collect();
        let added: Vec<serde_json::Value> = specials
            .iter()
            .enumerate()
            .map(|(i, s)| {
                serde_json::json!({"id": base + i, "content": s, "single_word": false,
                    "lstrip": false, "rstrip": false, "normalized": *s == "</s>",
                    "special": true})
            })
            .collect();
        let post = if template {
            serde_json::json!({"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [base + 1], "tokens": ["<s>"]}}})
        } else {
            serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
                "trim_offsets": true, "use_regex": true})
        };
        let json = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": added,
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": post,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": "", "end_of_word_suffix": "", "fuse_unk": false,
                "byte_fallback": false, "ignore_merges": false,
                "vocab": vocab_json,
                "merges": merges.iter().map(|(a, b)| format!("{a} {b}")).collect::<Vec<_>>()}
        });
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
        path.display().to_string()
    }

    fn fast_ids(enc: &mut ByteLevelEncoder<'_>, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        enc.encode_into(text, &mut out).unwrap();
        out
    }

    fn crate_ids(tok: &Tokenizer, text: &str) -> Vec<u32> {
        tok.encode(text, true).unwrap().get_ids().to_vec()
    }

    /// Texts that reach every branch of the GPT-2 pattern and the added-token split.
    const EDGE_TEXTS: &[&str] = &[
        "",
        " ",
        "the cat",
        " the  cat   \n\n the\tcat\r\n",
        "it's they're we've I'm you'll he'd 'S 'x",
        "12 123 1234 ١٢٣ ½ x²",
        "état café naïve Ünïcödé 東京 한국어 😀👍🏽 \u{200b}\u{a0}x",
        "<s>the</s>cat<|im_start|>user\n12<|im_end|><|endoftext|>",
        "<s><s> <|im_start|><|im_start|>x<|im_end|",
        "a  \n  b\n\n\n   c   ",
        "foo(bar)[0] = {\"k\": 1.5e-3}; // ??? !!! ...",
        "\u{85}\u{2028}\u{3000}end",
        "   leading and trailing   ",
    ];

    #[test]
    fn byte_chars_are_a_bijection_onto_the_gpt2_alphabet() {
        let c = byte_chars();
        let mut sorted: Vec<char> = c.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), 256);
        assert_eq!(c[b'a' as usize], 'a');
        assert_eq!(c[b' ' as usize], 'Ġ');
        assert_eq!(c[b'\n' as usize], 'Ċ');
        assert_eq!(c[0xAD], 'Ń');
        assert_eq!(c[0], 'Ā');
    }

    #[test]
    fn same_ids_as_the_crate_on_edge_cases() {
        let dir = tempfile::tempdir().unwrap();
        for template in [false, true] {
            let path = write_bytelevel_tokenizer(dir.path(), template);
            let tok = Tokenizer::from_file(&path).unwrap();
            let plan = ByteLevelPlan::from_tokenizer(&tok).expect("a byte-level BPE tokenizer");
            assert_eq!(plan.prefix.len(), usize::from(template));
            // A tiny cache too, so that both the hit and the full-cache paths run.
            for limit in [CACHE_BYTES, 64] {
                let mut enc = ByteLevelEncoder::with_cache(&plan, &tok, limit);
                for _ in 0..2 {
                    for t in EDGE_TEXTS {
                        assert_eq!(fast_ids(&mut enc, t), crate_ids(&tok, t), "text {t:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn other_tokenizers_take_the_crates_path() {
        let dir = tempfile::tempdir().unwrap();
        let word = crate::tokenize::tests::write_word_tokenizer(dir.path(), None);
        let tok = Tokenizer::from_file(&word).unwrap();
        assert!(
            ByteLevelPlan::from_tokenizer(&tok).is_none(),
            "word-level model"
        );
        // A byte-level tokenizer with an lstrip added token, or dropout, is refused too.
        let path = write_bytelevel_tokenizer(dir.path(), false);
        let mut json: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        json["added_tokens"][0]["lstrip"] = true.into();
        std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
        assert!(ByteLevelPlan::from_tokenizer(&Tokenizer::from_file(&path).unwrap()).is_none());
        json["added_tokens"][0]["lstrip"] = false.into();
        json["model"]["dropout"] = 0.5.into();
        std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
        assert!(ByteLevelPlan::from_tokenizer(&Tokenizer::from_file(&path).unwrap()).is_none());
        json["model"]["dropout"] = serde_json::Value::Null;
        json["normalizer"] = serde_json::json!({"type": "Lowercase"});
        std::fs::write(&path, serde_json::to_vec(&json).unwrap()).unwrap();
        assert!(ByteLevelPlan::from_tokenizer(&Tokenizer::from_file(&path).unwrap()).is_none());
    }

    /// The real SmolLM2 tokenizer and ShareGPT training split, where the project caches them
    /// (`$DART_CACHE`, else `~/.cache/dart`; built by `dart_client.ngram.embedded`).
    fn real_data() -> Option<(std::path::PathBuf, std::path::PathBuf)> {
        let root = std::env::var_os("DART_CACHE")
            .map(std::path::PathBuf::from)
            .or_else(|| {
                std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache/dart"))
            })?;
        let tok = root.join("smollm2-tokenizer/tokenizer.json");
        let corpus = root.join("sharegpt-train.smollm2.jsonl");
        (tok.is_file() && corpus.is_file()).then_some((tok, corpus))
    }

    /// The fast path against the crate on real ShareGPT text with the real SmolLM2 tokenizer
    /// (code, unicode, whitespace runs, digits, chat special tokens): the first 300 documents,
    /// or `DART_TOKENIZE_CHECK_DOCS` of them (`all` for the whole split). Needs the cached data
    /// that `make test` prepares before running it with `--ignored` (as `make demo` does:
    /// `python -c "from dart_client.ngram.embedded import corpus_jsonl; corpus_jsonl()"`);
    /// run that way without the data, it fails saying so.
    #[test]
    #[ignore = "needs the cached SmolLM2 tokenizer and ShareGPT JSONL: `make test` prepares them and runs it"]
    fn same_ids_as_the_crate_on_real_sharegpt() {
        let (tok_path, corpus) = real_data().expect(
            "no cached SmolLM2 tokenizer and ShareGPT JSONL under $DART_CACHE (~/.cache/dart): \
             run `python -c \"from dart_client.ngram.embedded import corpus_jsonl; corpus_jsonl()\"`",
        );
        let limit = match std::env::var("DART_TOKENIZE_CHECK_DOCS").as_deref() {
            Ok("all") => usize::MAX,
            Ok(n) => n
                .parse()
                .expect("DART_TOKENIZE_CHECK_DOCS: a number or `all`"),
            Err(_) => 300,
        };
        let tok = Tokenizer::from_file(&tok_path).unwrap();
        let plan = ByteLevelPlan::from_tokenizer(&tok).expect("SmolLM2 is byte-level BPE");
        let mut enc = ByteLevelEncoder::new(&plan, &tok);
        let text = std::fs::read_to_string(&corpus).unwrap();
        let (mut docs, mut tokens) = (0, 0);
        for line in text.lines().take(limit) {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            let doc = v["text"].as_str().unwrap();
            let want = crate_ids(&tok, doc);
            assert_eq!(fast_ids(&mut enc, doc), want, "document {docs}");
            docs += 1;
            tokens += want.len();
        }
        // Special tokens inside real text, and whitespace and digits around them.
        for t in EDGE_TEXTS {
            assert_eq!(fast_ids(&mut enc, t), crate_ids(&tok, t), "text {t:?}");
        }
        eprintln!("{docs} documents, {tokens} tokens: same ids");
        assert!(docs > 0);
    }

    /// Pieces random texts are made of: whitespace runs, digits, letters of several scripts,
    /// punctuation, contractions, special tokens (whole and broken).
    fn piece() -> impl Strategy<Value = String> {
        prop_oneof![
            prop::sample::select(vec![
                " ",
                "  ",
                "\n",
                "\n\n",
                "\t",
                "\r\n",
                "\u{a0}",
                "\u{3000}",
                "'s",
                "'ll",
                "'",
                "the",
                "cat",
                "é",
                "ét",
                "東",
                "😀",
                "1",
                "12",
                "٣",
                ".",
                "...",
                "(",
                "\"",
                "<s>",
                "</s>",
                "<|im_start|>",
                "<|im_end|>",
                "<|endoftext|>",
                "<|im",
                "s>",
                "_",
                "-",
            ])
            .prop_map(String::from),
            any::<char>().prop_map(String::from),
        ]
    }

    proptest! {
        #[test]
        fn same_ids_as_the_crate_on_random_text(
            pieces in prop::collection::vec(piece(), 0..40),
            template in any::<bool>(),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let path = write_bytelevel_tokenizer(dir.path(), template);
            let tok = Tokenizer::from_file(&path).unwrap();
            let plan = ByteLevelPlan::from_tokenizer(&tok).unwrap();
            let mut enc = ByteLevelEncoder::new(&plan, &tok);
            let text: String = pieces.concat();
            prop_assert_eq!(fast_ids(&mut enc, &text), crate_ids(&tok, &text));
            // Cached words give the same ids the second time.
            prop_assert_eq!(fast_ids(&mut enc, &text), crate_ids(&tok, &text));
        }
    }
}
