//! Corpus inputs: discovering files, reading them in batches, and decoding one document.
//!
//! * JSON lines (`.jsonl`, `.json`, `.ndjson`): one document per line; a line with an `ids`
//!   field is already tokenized, otherwise its text field (`--text-field`, default `text`)
//!   is tokenized. Blank lines are skipped.
//! * Anything else is plain text: one document per file.
//! * A `.gz` suffix on either is decompressed on the fly.
//! * Directories are walked recursively in sorted order (hidden entries skipped), so a build
//!   sees the same documents in the same order every time.

use std::borrow::Cow;
use std::fmt;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use dart_ngram::error::{NGramError, Result};
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};

/// How a file's contents are split into documents.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputKind {
    JsonLines,
    Text,
}

/// One input file.
#[derive(Clone, Debug)]
pub struct InputFile {
    pub path: PathBuf,
    pub kind: InputKind,
    pub gzip: bool,
    /// Size on disk (compressed size for `.gz`), for progress.
    pub bytes: u64,
    /// A regular file (not a pipe or device): `bytes` is its real size.
    pub regular: bool,
}

fn classify(path: &Path, meta: &std::fs::Metadata) -> InputFile {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().to_ascii_lowercase())
        .unwrap_or_default();
    let (stem, gzip) = match name.strip_suffix(".gz") {
        Some(s) => (s.to_string(), true),
        None => (name, false),
    };
    let kind = if [".jsonl", ".json", ".ndjson"]
        .iter()
        .any(|e| stem.ends_with(e))
    {
        InputKind::JsonLines
    } else {
        InputKind::Text
    };
    InputFile {
        path: path.to_path_buf(),
        kind,
        gzip,
        bytes: meta.len(),
        regular: meta.is_file(),
    }
}

/// Expands the given paths (files or directories) into the list of input files.
pub fn collect_inputs(paths: &[PathBuf]) -> Result<Vec<InputFile>> {
    if paths.is_empty() {
        return Err(NGramError::InvalidArgument(
            "no input given; expected at least one file or directory (--input)".into(),
        ));
    }
    let mut out = Vec::new();
    for p in paths {
        let meta = std::fs::metadata(p).map_err(|e| NGramError::io(p, e))?;
        if meta.is_dir() {
            let before = out.len();
            walk(p, &mut out)?;
            if out.len() == before {
                return Err(NGramError::InvalidArgument(format!(
                    "{}: the directory holds no input files",
                    p.display()
                )));
            }
        } else if meta.is_file() && is_model(p) {
            return Err(NGramError::InvalidArgument(format!(
                "{}: this is a DART n-gram model, not corpus text; give the corpus files",
                p.display()
            )));
        } else {
            out.push(classify(p, &meta));
        }
    }
    Ok(out)
}

/// Whether the regular file `path` starts with the n-gram model magic (an earlier build's
/// output sitting in a corpus directory is skipped, not read as text). Never called on pipes:
/// reading them would consume the corpus.
fn is_model(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 8];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok_and(|()| magic == dart_ngram::format::MAGIC)
}

fn walk(dir: &Path, out: &mut Vec<InputFile>) -> Result<()> {
    let mut entries = std::fs::read_dir(dir)
        .map_err(|e| NGramError::io(dir, e))?
        .map(|e| e.map(|e| e.path()))
        .collect::<std::io::Result<Vec<PathBuf>>>()
        .map_err(|e| NGramError::io(dir, e))?;
    entries.sort();
    for path in entries {
        let hidden = path
            .file_name()
            .is_some_and(|n| n.to_string_lossy().starts_with('.'));
        if hidden {
            continue;
        }
        // metadata() follows symlinks, so linked shards are read like real ones.
        let meta = std::fs::metadata(&path).map_err(|e| NGramError::io(&path, e))?;
        if meta.is_dir() {
            walk(&path, out)?;
        } else if meta.is_file() && !is_model(&path) {
            out.push(classify(&path, &meta));
        }
    }
    Ok(())
}

/// A batch of raw lines (or one whole text file) handed from the reader to a worker.
pub struct RawBatch {
    pub file: Arc<InputFile>,
    /// 1-based line number of the first line (1 for a whole text file).
    pub first_line: u64,
    /// The lines' bytes, back to back, newlines stripped.
    pub data: Vec<u8>,
    /// End offset in `data` of each line.
    pub ends: Vec<usize>,
}

impl RawBatch {
    pub fn lines(&self) -> impl Iterator<Item = (u64, &[u8])> + '_ {
        let starts = std::iter::once(0).chain(self.ends.iter().copied());
        starts
            .zip(self.ends.iter().copied())
            .enumerate()
            .map(|(i, (s, e))| (self.first_line + i as u64, &self.data[s..e]))
    }
}

/// Counts bytes as they are read, for progress on compressed input.
struct Counting<R> {
    inner: R,
    counter: Arc<AtomicU64>,
}

impl<R: Read> Read for Counting<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.counter.fetch_add(n as u64, Ordering::Relaxed);
        Ok(n)
    }
}

fn open_reader(file: &InputFile, counter: &Arc<AtomicU64>) -> Result<Box<dyn BufRead + Send>> {
    let f = File::open(&file.path).map_err(|e| NGramError::io(&file.path, e))?;
    let counted = Counting {
        inner: f,
        counter: counter.clone(),
    };
    Ok(if file.gzip {
        Box::new(BufReader::with_capacity(
            256 * 1024,
            flate2::read::MultiGzDecoder::new(BufReader::with_capacity(256 * 1024, counted)),
        ))
    } else {
        Box::new(BufReader::with_capacity(256 * 1024, counted))
    })
}

/// Reads every file in order and hands batches of about `batch_bytes` to `send`, which
/// returns `false` when the consumer is gone. `bytes_read` counts input bytes (compressed
/// for `.gz`) for progress.
pub fn read_batches(
    files: &[Arc<InputFile>],
    batch_bytes: usize,
    bytes_read: &Arc<AtomicU64>,
    cancel: Option<&AtomicBool>,
    mut send: impl FnMut(RawBatch) -> bool,
) -> Result<()> {
    for file in files {
        if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
            return Err(crate::extsort::interrupted());
        }
        let mut reader = open_reader(file, bytes_read)?;
        let io = |e: std::io::Error| NGramError::io(&file.path, e);
        if file.kind == InputKind::Text {
            let mut data = Vec::with_capacity(file.bytes as usize);
            reader.read_to_end(&mut data).map_err(io)?;
            let ends = vec![data.len()];
            if !send(RawBatch {
                file: file.clone(),
                first_line: 1,
                data,
                ends,
            }) {
                return Ok(());
            }
            continue;
        }
        let mut line_no = 0u64;
        let mut batch = RawBatch {
            file: file.clone(),
            first_line: 1,
            data: Vec::with_capacity(batch_bytes + 4096),
            ends: Vec::new(),
        };
        loop {
            let start = batch.data.len();
            let n = reader.read_until(b'\n', &mut batch.data).map_err(io)?;
            if n == 0 {
                break;
            }
            line_no += 1;
            // Strip "\n" or "\r\n": offsets then delimit exactly the line's content.
            if batch.data.last() == Some(&b'\n') {
                batch.data.pop();
                if batch.data.last() == Some(&b'\r') {
                    batch.data.pop();
                }
            }
            if line_no == 1 && batch.data[start..].starts_with(b"\xEF\xBB\xBF") {
                batch.data.drain(start..start + 3);
            }
            batch.ends.push(batch.data.len());
            if batch.data.len() >= batch_bytes {
                if cancel.is_some_and(|c| c.load(Ordering::Relaxed)) {
                    return Err(crate::extsort::interrupted());
                }
                let next = RawBatch {
                    file: file.clone(),
                    first_line: line_no + 1,
                    data: Vec::with_capacity(batch_bytes + 4096),
                    ends: Vec::new(),
                };
                if !send(std::mem::replace(&mut batch, next)) {
                    return Ok(());
                }
            }
        }
        if !batch.ends.is_empty() && !send(batch) {
            return Ok(());
        }
    }
    Ok(())
}

/// One decoded document.
#[derive(Debug, PartialEq)]
pub enum Doc<'a> {
    Text(Cow<'a, str>),
    Ids(Vec<u64>),
}

/// Why a line could not be decoded (the caller adds `file:line`).
#[derive(Debug)]
pub struct LineError(pub String);

impl fmt::Display for LineError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Decodes one JSON line. `Ok(None)` for a blank line.
pub fn parse_json_line<'a>(
    line: &'a [u8],
    text_field: &str,
) -> std::result::Result<Option<Doc<'a>>, LineError> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let mut de = serde_json::Deserializer::from_slice(line);
    let parsed = LineSeed { text_field }
        .deserialize(&mut de)
        .and_then(|p| de.end().map(|()| p))
        .map_err(|e| LineError(format!("malformed JSON line: {e}")))?;
    match parsed {
        Parsed { ids: Some(ids), .. } => Ok(Some(Doc::Ids(ids))),
        Parsed { text: Some(t), .. } => Ok(Some(Doc::Text(t))),
        _ => Err(LineError(format!(
            "the JSON object has no {text_field:?} field and no \"ids\" field; expected one \
             (--text-field names the text field)"
        ))),
    }
}

/// Decodes a whole plain-text file.
pub fn parse_text_file(data: &[u8]) -> std::result::Result<Doc<'_>, LineError> {
    std::str::from_utf8(data)
        .map(|s| Doc::Text(Cow::Borrowed(s)))
        .map_err(|e| {
            LineError(format!(
                "not valid UTF-8 text (invalid byte at offset {}); expected a UTF-8 text file",
                e.valid_up_to()
            ))
        })
}

struct Parsed<'a> {
    text: Option<Cow<'a, str>>,
    ids: Option<Vec<u64>>,
}

/// Deserializes only the two fields a build reads; all others are skipped unparsed.
struct LineSeed<'f> {
    text_field: &'f str,
}

impl<'de> DeserializeSeed<'de> for LineSeed<'_> {
    type Value = Parsed<'de>;

    fn deserialize<D: de::Deserializer<'de>>(
        self,
        d: D,
    ) -> std::result::Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for LineSeed<'_> {
    type Value = Parsed<'de>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a JSON object")
    }

    fn visit_map<A: MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut out = Parsed {
            text: None,
            ids: None,
        };
        while let Some(Str(key)) = map.next_key::<Str<'de>>()? {
            if key == "ids" {
                out.ids = Some(map.next_value::<Ids>()?.0);
            } else if key == self.text_field {
                let Str(t) = map.next_value::<Str<'de>>().map_err(|e| {
                    de::Error::custom(format_args!("field {:?}: {e}", self.text_field))
                })?;
                out.text = Some(t);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(out)
    }
}

/// A string borrowed from the line when it has no escapes (serde's `Cow` always copies).
struct Str<'a>(Cow<'a, str>);

impl<'de> de::Deserialize<'de> for Str<'de> {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(
                self,
                v: &'de str,
            ) -> std::result::Result<Self::Value, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> std::result::Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> std::result::Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// The `ids` array: non-negative integers (range-checked against the vocabulary later).
struct Ids(Vec<u64>);

impl<'de> de::Deserialize<'de> for Ids {
    fn deserialize<D: de::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Ids;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("an array of token ids (non-negative integers)")
            }
            fn visit_seq<A: SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> std::result::Result<Ids, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(256));
                while let Some(n) = seq.next_element::<serde_json::Number>()? {
                    match n.as_u64() {
                        Some(v) => out.push(v),
                        None => {
                            return Err(de::Error::custom(format_args!(
                                "field \"ids\": element {} is {n}; expected a non-negative integer token id",
                                out.len()
                            )))
                        }
                    }
                }
                Ok(Ids(out))
            }
        }
        d.deserialize_seq(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn parses_text_ids_and_blank_lines() {
        let doc = parse_json_line(
            br#"{"id": 3, "meta": {"a": [1, 2]}, "text": "hi there"}"#,
            "text",
        )
        .unwrap();
        assert!(matches!(doc, Some(Doc::Text(Cow::Borrowed("hi there")))));
        let doc = parse_json_line(br#"{"text": "a\nb"}"#, "text").unwrap();
        assert_eq!(doc, Some(Doc::Text(Cow::Owned("a\nb".into()))));
        let doc = parse_json_line(br#"{"content": "x"}"#, "content").unwrap();
        assert_eq!(doc, Some(Doc::Text("x".into())));
        // ids wins over text when both are present.
        let doc = parse_json_line(br#"{"text": "x", "ids": [5, 0, 7]}"#, "text").unwrap();
        assert_eq!(doc, Some(Doc::Ids(vec![5, 0, 7])));
        assert_eq!(parse_json_line(b"   ", "text").unwrap(), None);
        assert_eq!(parse_json_line(b"", "text").unwrap(), None);
    }

    #[test]
    fn rejects_bad_lines_with_reasons() {
        let cases: &[(&[u8], &str)] = &[
            (br#"{"text": "unterminated"#, "malformed JSON"),
            (br#"{"other": 1}"#, "no \"text\" field"),
            (br#"{"text": 3}"#, "field \"text\""),
            (br#"{"ids": [1, -2]}"#, "element 1 is -2"),
            (br#"{"ids": [1.5]}"#, "element 0 is 1.5"),
            (br#"{"ids": "1 2"}"#, "array of token ids"),
            (br#"[1, 2]"#, "a JSON object"),
            (br#"{"text": "a"} {"text": "b"}"#, "trailing"),
        ];
        for (line, want) in cases {
            let err = parse_json_line(line, "text").unwrap_err();
            assert!(
                err.0.contains(want),
                "{:?}: {err} lacks {want:?}",
                String::from_utf8_lossy(line)
            );
        }
    }

    #[test]
    fn text_files_must_be_utf8() {
        assert_eq!(parse_text_file(b"ok").unwrap(), Doc::Text("ok".into()));
        let err = parse_text_file(b"ab\xff").unwrap_err();
        assert!(err.0.contains("offset 2"), "{err}");
    }

    #[test]
    fn directories_are_walked_sorted_and_classified() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir_all(d.join("b/sub")).unwrap();
        for name in [
            "b/sub/z.txt",
            "b/a.jsonl",
            "b/c.json.gz",
            "b/.hidden",
            "a.md",
            "b/x.JSONL",
        ] {
            std::fs::write(d.join(name), "x").unwrap();
        }
        let files = collect_inputs(&[d.to_path_buf()]).unwrap();
        let rel: Vec<(String, InputKind, bool)> = files
            .iter()
            .map(|f| {
                (
                    f.path.strip_prefix(d).unwrap().display().to_string(),
                    f.kind,
                    f.gzip,
                )
            })
            .collect();
        assert_eq!(
            rel,
            vec![
                ("a.md".into(), InputKind::Text, false),
                ("b/a.jsonl".into(), InputKind::JsonLines, false),
                ("b/c.json.gz".into(), InputKind::JsonLines, true),
                ("b/sub/z.txt".into(), InputKind::Text, false),
                ("b/x.JSONL".into(), InputKind::JsonLines, false),
            ]
        );
        assert!(collect_inputs(&[]).is_err());
        let err = collect_inputs(&[d.join("missing")]).unwrap_err();
        assert!(err.to_string().contains("missing"), "{err}");
        std::fs::create_dir(d.join("empty")).unwrap();
        let err = collect_inputs(&[d.join("empty")]).unwrap_err();
        assert!(err.to_string().contains("no input files"), "{err}");
    }

    #[test]
    fn reader_batches_lines_with_numbers() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.jsonl.gz");
        let mut gz =
            flate2::write::GzEncoder::new(File::create(&p).unwrap(), flate2::Compression::fast());
        let mut want = Vec::new();
        gz.write_all(b"\xEF\xBB\xBF").unwrap();
        for i in 0..1000 {
            let line = format!("{{\"text\": \"line {i}\"}}");
            write!(gz, "{line}{}", if i % 2 == 0 { "\r\n" } else { "\n" }).unwrap();
            want.push((i as u64 + 1, line));
        }
        gz.finish().unwrap();
        let files = collect_inputs(&[p]).unwrap();
        let files: Vec<Arc<InputFile>> = files.into_iter().map(Arc::new).collect();
        let counter = Arc::new(AtomicU64::new(0));
        let mut got = Vec::new();
        let mut batches = 0;
        read_batches(&files, 100, &counter, None, |b| {
            batches += 1;
            got.extend(
                b.lines()
                    .map(|(n, l)| (n, String::from_utf8(l.to_vec()).unwrap())),
            );
            true
        })
        .unwrap();
        assert_eq!(got, want);
        assert!(batches > 100);
        assert_eq!(counter.load(Ordering::Relaxed), files[0].bytes);
    }
}
