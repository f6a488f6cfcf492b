//! Python binding of `dart_ngram::NGramModel` (`dart_client._native.NGram`).
//!
//! Token ids arrive as int64 numpy arrays (the Python wrapper in `dart_client/ngram/model.py`
//! converts lists and other integer dtypes) and are range-checked here; results go back as
//! numpy arrays that own the Rust buffers (no copy). All work runs with the GIL released.

use std::path::PathBuf;
use std::sync::Arc;

use dart_ngram::{merge_models, MergeOptions, NGramModel, OpenOptions, WriteOptions};
use numpy::{
    PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use rayon::prelude::*;

use crate::arrays::c_order;
use crate::errors::{to_py, NGramError, TokenOutOfVocabError};

/// Two numpy arrays returned together (probabilities and matched lengths, or ids and probs).
type Pair<'py, A, B> = (Bound<'py, A>, Bound<'py, B>);

/// A mapped n-gram model (see `dart_client.ngram.NGram` for the documented API).
#[pyclass(name = "NGram", module = "dart_client._native", subclass, frozen)]
pub struct PyNGram {
    model: Arc<NGramModel>,
}

impl PyNGram {
    /// The shared model, for other bindings (the pruner) that query it from Rust.
    pub fn model(&self) -> Arc<NGramModel> {
        Arc::clone(&self.model)
    }
}

/// int64 ids -> u32, refusing negative and too-large ids (the model checks the vocabulary).
fn ids(v: &[i64]) -> PyResult<Vec<u32>> {
    v.iter()
        .map(|&x| {
            u32::try_from(x).map_err(|_| {
                TokenOutOfVocabError::new_err(format!(
                    "token id {x} is not a valid id (expected 0 <= id < vocabulary size)"
                ))
            })
        })
        .collect()
}

fn slice<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    a: &'a numpy::PyReadonlyArray<'_, T, D>,
    what: &str,
) -> PyResult<&'a [T]> {
    c_order(a).ok_or_else(|| NGramError::new_err(format!("{what} must be a C-contiguous array")))
}

fn json_to_py(py: Python<'_>, v: &impl serde::Serialize) -> PyResult<Py<PyAny>> {
    let s = serde_json::to_string(v).map_err(|e| NGramError::new_err(e.to_string()))?;
    Ok(py.import("json")?.call_method1("loads", (s,))?.unbind())
}

#[pymethods]
impl PyNGram {
    #[new]
    #[allow(clippy::too_many_arguments)] // keyword-only options of one constructor
    #[pyo3(signature = (path, *, verify=false, populate=false, lock=false, huge_pages=false, in_memory=false, checksums=true, random_access=false, prefetch=false))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        verify: bool,
        populate: bool,
        lock: bool,
        huge_pages: bool,
        in_memory: bool,
        checksums: bool,
        random_access: bool,
        prefetch: bool,
    ) -> PyResult<Self> {
        let opts = OpenOptions {
            verify,
            populate,
            lock,
            huge_pages,
            in_memory,
            skip_checksums: !checksums,
            random_access,
            prefetch,
        };
        let model = py
            .detach(|| NGramModel::open_with(&path, &opts))
            .map_err(to_py)?;
        Ok(PyNGram {
            model: Arc::new(model),
        })
    }

    #[getter]
    fn order(&self) -> usize {
        self.model.order()
    }
    #[getter]
    fn vocab_size(&self) -> u32 {
        self.model.vocab_size()
    }
    #[getter]
    fn fingerprint(&self) -> String {
        self.model.info().tokenizer_fingerprint
    }
    #[getter]
    fn eos_id(&self) -> Option<u32> {
        self.model.eos_id()
    }
    #[getter]
    fn path(&self) -> String {
        self.model.path().display().to_string()
    }
    #[getter]
    fn total_tokens(&self) -> u64 {
        self.model.total_tokens()
    }

    fn count(&self, py: Python<'_>, tokens: PyReadonlyArray1<'_, i64>) -> PyResult<u64> {
        self.model.check_unchanged().map_err(to_py)?;
        let t = ids(slice(&tokens, "tokens")?)?;
        py.detach(|| self.model.count(&t)).map_err(to_py)
    }

    fn prob<'py>(
        &self,
        py: Python<'py>,
        context: PyReadonlyArray1<'py, i64>,
        candidates: PyReadonlyArray1<'py, i64>,
    ) -> PyResult<Pair<'py, PyArray1<f32>, PyArray1<u8>>> {
        self.model.check_unchanged().map_err(to_py)?;
        let ctx = ids(slice(&context, "context")?)?;
        let cands = ids(slice(&candidates, "candidates")?)?;
        let (probs, matched) = py
            .detach(|| {
                let mut p = vec![0f32; cands.len()];
                let mut m = vec![0u8; cands.len()];
                self.model
                    .prob_many(&ctx, &cands, &mut p, &mut m)
                    .map(|_| (p, m))
            })
            .map_err(to_py)?;
        Ok((
            PyArray1::from_vec(py, probs),
            PyArray1::from_vec(py, matched),
        ))
    }

    fn prob_batch<'py>(
        &self,
        py: Python<'py>,
        contexts: PyReadonlyArray2<'py, i64>,
        candidates: PyReadonlyArray2<'py, i64>,
    ) -> PyResult<Pair<'py, PyArray2<f32>, PyArray2<u8>>> {
        self.model.check_unchanged().map_err(to_py)?;
        let (rows, width) = (contexts.shape()[0], contexts.shape()[1]);
        let (crows, ncand) = (candidates.shape()[0], candidates.shape()[1]);
        if rows != crows {
            return Err(NGramError::new_err(format!(
                "prob_batch: {rows} context rows but {crows} candidate rows; expected one per context"
            )));
        }
        let ctx = ids(slice(&contexts, "contexts")?)?;
        let cands = ids(slice(&candidates, "candidates")?)?;
        let model = &self.model;
        let (probs, matched) = py
            .detach(|| {
                let mut p = vec![0f32; rows * ncand];
                let mut m = vec![0u8; rows * ncand];
                if ncand > 0 {
                    p.par_chunks_mut(ncand)
                        .zip(m.par_chunks_mut(ncand))
                        .enumerate()
                        .try_for_each(|(r, (pr, mr))| {
                            model.prob_many(
                                &ctx[r * width..(r + 1) * width],
                                &cands[r * ncand..(r + 1) * ncand],
                                pr,
                                mr,
                            )
                        })?;
                }
                Ok((p, m))
            })
            .map_err(to_py)?;
        Ok((
            PyArray1::from_vec(py, probs).reshape([rows, ncand])?,
            PyArray1::from_vec(py, matched).reshape([rows, ncand])?,
        ))
    }

    fn top_k<'py>(
        &self,
        py: Python<'py>,
        context: PyReadonlyArray1<'py, i64>,
        k: usize,
    ) -> PyResult<Pair<'py, PyArray1<i64>, PyArray1<f32>>> {
        self.model.check_unchanged().map_err(to_py)?;
        self.model.check_top_k(1, k).map_err(to_py)?;
        let ctx = ids(slice(&context, "context")?)?;
        let top = py.detach(|| self.model.top_k(&ctx, k)).map_err(to_py)?;
        let ids: Vec<i64> = top.iter().map(|x| i64::from(x.0)).collect();
        let probs: Vec<f32> = top.iter().map(|x| x.1).collect();
        Ok((PyArray1::from_vec(py, ids), PyArray1::from_vec(py, probs)))
    }

    fn top_k_batch<'py>(
        &self,
        py: Python<'py>,
        contexts: PyReadonlyArray2<'py, i64>,
        k: usize,
    ) -> PyResult<Pair<'py, PyArray2<i64>, PyArray2<f32>>> {
        self.model.check_unchanged().map_err(to_py)?;
        let (rows, width) = (contexts.shape()[0], contexts.shape()[1]);
        self.model.check_top_k(rows, k).map_err(to_py)?;
        let ctx = ids(slice(&contexts, "contexts")?)?;
        let model = &self.model;
        let (ids_out, probs) = py
            .detach(|| {
                let mut ids_out = vec![-1i64; rows * k];
                let mut p = vec![0f32; rows * k];
                if k > 0 {
                    ids_out
                        .par_chunks_mut(k)
                        .zip(p.par_chunks_mut(k))
                        .enumerate()
                        .try_for_each(|(r, (ir, pr))| {
                            let top = model.top_k(&ctx[r * width..(r + 1) * width], k)?;
                            for (j, (t, q)) in top.into_iter().enumerate() {
                                ir[j] = i64::from(t);
                                pr[j] = q;
                            }
                            Ok::<(), dart_ngram::NGramError>(())
                        })?;
                }
                Ok((ids_out, p))
            })
            .map_err(to_py)?;
        Ok((
            PyArray1::from_vec(py, ids_out).reshape([rows, k])?,
            PyArray1::from_vec(py, probs).reshape([rows, k])?,
        ))
    }

    fn info(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        json_to_py(py, &self.model.info())
    }

    fn verify(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.model.verify()).map_err(to_py)
    }

    fn check_fingerprint(&self, expected_hex: &str) -> PyResult<()> {
        let bytes = parse_hex(expected_hex)?;
        self.model.check_fingerprint(&bytes).map_err(to_py)
    }

    #[staticmethod]
    #[pyo3(signature = (inputs, output, *, min_count=1, allow_pruned=false, top_list_len=32))]
    fn merge(
        py: Python<'_>,
        inputs: Vec<PathBuf>,
        output: PathBuf,
        min_count: u64,
        allow_pruned: bool,
        top_list_len: u32,
    ) -> PyResult<Py<PyAny>> {
        let opts = MergeOptions {
            allow_pruned,
            min_count,
            write: WriteOptions {
                top_list_len,
                ..Default::default()
            },
            ..Default::default()
        };
        let report = py
            .detach(|| {
                let refs: Vec<&std::path::Path> = inputs.iter().map(|p| p.as_path()).collect();
                merge_models(&refs, &output, &opts)
            })
            .map_err(to_py)?;
        let v = serde_json::json!({
            "path": output.display().to_string(),
            "ngrams_per_order": report.ngrams_per_order,
            "bytes": report.bytes,
        });
        json_to_py(py, &v)
    }

    /// Writes a model from explicit counts: `counts` maps token tuples (orders 1..=order) to
    /// counts; it must be prefix-closed and consistent (checked by the writer).
    #[staticmethod]
    #[pyo3(signature = (path, counts, *, order, vocab_size, eos_id=None, total_tokens=None,
        documents=0, min_count=1, fingerprint=None, top_list_len=32, source=None))]
    #[allow(clippy::too_many_arguments)]
    fn write_counts(
        py: Python<'_>,
        path: PathBuf,
        counts: std::collections::HashMap<Vec<u32>, u64>,
        order: usize,
        vocab_size: u32,
        eos_id: Option<u32>,
        total_tokens: Option<u64>,
        documents: u64,
        min_count: u64,
        fingerprint: Option<&str>,
        top_list_len: u32,
        source: Option<String>,
    ) -> PyResult<Py<PyAny>> {
        let tokenizer_fingerprint = match fingerprint {
            Some(h) => parse_hex(h)?,
            None => [0u8; 32],
        };
        dart_ngram::key::check_order_fits(order, vocab_size).map_err(to_py)?;
        let bits = dart_ngram::key::token_bits(vocab_size);
        let mut unigrams = vec![0u64; vocab_size as usize];
        let mut levels: Vec<Vec<(u64, u64)>> = vec![Vec::new(); order.saturating_sub(1)];
        for (g, c) in counts {
            if let Some(&t) = g.iter().find(|&&t| t >= vocab_size) {
                return Err(to_py(dart_ngram::NGramError::TokenOutOfVocab {
                    token: u64::from(t),
                    vocab_size,
                }));
            }
            match g.len() {
                1 => unigrams[g[0] as usize] = c,
                n if (2..=order).contains(&n) => {
                    levels[n - 2].push((dart_ngram::key::pack(&g, bits), c))
                }
                n => {
                    return Err(NGramError::new_err(format!(
                        "n-gram {g:?} has {n} tokens; expected 1..={order}"
                    )))
                }
            }
        }
        let meta = dart_ngram::ModelMeta {
            order,
            vocab_size,
            tokenizer_fingerprint,
            eos_id,
            min_count,
            total_tokens: total_tokens.unwrap_or_else(|| unigrams.iter().sum()),
            documents,
            source: source.unwrap_or_else(|| "dart_client.ngram.NGram.write_counts".into()),
        };
        let report = py
            .detach(|| {
                let streams: Vec<dart_ngram::CountStream<'static>> = levels
                    .into_iter()
                    .map(|mut v| {
                        v.sort_unstable();
                        Box::new(v.into_iter().map(Ok)) as dart_ngram::CountStream<'static>
                    })
                    .collect();
                dart_ngram::write_model(
                    &path,
                    &meta,
                    &unigrams,
                    streams,
                    &WriteOptions {
                        top_list_len,
                        ..Default::default()
                    },
                )
            })
            .map_err(to_py)?;
        let v = serde_json::json!({
            "path": path.display().to_string(),
            "ngrams_per_order": report.ngrams_per_order,
            "bytes": report.bytes,
        });
        json_to_py(py, &v)
    }

    fn __repr__(&self) -> String {
        format!(
            "NGram(path={:?}, order={}, vocab_size={})",
            self.model.path().display().to_string(),
            self.model.order(),
            self.model.vocab_size()
        )
    }
}

fn parse_hex(s: &str) -> PyResult<[u8; 32]> {
    let bad = || NGramError::new_err(format!("fingerprint {s:?} is not 64 hexadecimal digits"));
    if s.len() != 64 || !s.is_ascii() {
        return Err(bad());
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).map_err(|_| bad())?;
    }
    Ok(out)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyNGram>()
}
