//! Python binding of `dart_pruner::Pruner` over a mapped model (`dart_client._native.Pruner`).
//!
//! Ids arrive as int64 numpy arrays and probabilities as float32 (the wrapper in
//! `dart_client/ngram/pruner.py` converts lists, tensors and other dtypes, and passes only the tail
//! of the context the n-gram model reads). Each tree goes back as a tuple of numpy arrays that
//! own the Rust buffers (no copy): `(tokens, parents, depths, attention_mask, retrieve_indices,
//! scores)`. The work runs with the GIL released.

use std::sync::Arc;

use dart_ngram::NGramModel;
use dart_pruner::{DraftTree, OwnedRequest, PromptLookup, Pruner, PrunerConfig};
use numpy::ndarray::{Array2, Array3};
use numpy::{
    IntoPyArray, PyArray1, PyArray2, PyArray3, PyReadonlyArray1, PyReadonlyArray2,
    PyReadonlyArray3, PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

type CoreError = dart_pruner::PrunerError;

use crate::arrays::c_order;
use crate::errors::{to_py, TokenOutOfVocabError};
use crate::ngram::PyNGram;

pyo3::create_exception!(
    dart_client._native,
    PrunerError,
    pyo3::exceptions::PyValueError,
    "Bad pruner input or configuration (a ValueError); out-of-vocabulary ids raise \
     TokenOutOfVocabError and n-gram lookup failures the NGramError family."
);

/// A tree as Python receives it: `(tokens, parents, depths, attention_mask,
/// retrieve_indices, scores)`.
pub(crate) type PyTree<'py> = (
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray1<i64>>,
    Bound<'py, PyArray2<bool>>,
    Bound<'py, PyArray2<i64>>,
    Bound<'py, PyArray1<f64>>,
);

fn to_py_err(err: CoreError) -> PyErr {
    match err {
        CoreError::NGram(inner) => to_py(inner),
        e @ CoreError::TokenOutOfVocab { .. } => TokenOutOfVocabError::new_err(e.to_string()),
        e => PrunerError::new_err(e.to_string()),
    }
}

fn tree_to_py(py: Python<'_>, tree: DraftTree) -> PyResult<PyTree<'_>> {
    let n = tree.len();
    let (leaves, width) = (tree.num_leaves(), tree.retrieve_width());
    let shape_err = |e: numpy::ndarray::ShapeError| PrunerError::new_err(e.to_string());
    let mask = Array2::from_shape_vec((n, n), tree.attention_mask).map_err(shape_err)?;
    let retrieve =
        Array2::from_shape_vec((leaves, width), tree.retrieve_indices).map_err(shape_err)?;
    Ok((
        PyArray1::from_vec(py, tree.tokens),
        PyArray1::from_vec(py, tree.parents),
        PyArray1::from_vec(py, tree.depths),
        mask.into_pyarray(py),
        retrieve.into_pyarray(py),
        PyArray1::from_vec(py, tree.scores),
    ))
}

/// Trees padded into one set of arrays: `(tokens, parents, depths, mask, sizes)`.
pub(crate) type PyPaddedTrees<'py> = (
    Bound<'py, PyArray2<i64>>,
    Bound<'py, PyArray2<i64>>,
    Bound<'py, PyArray2<i64>>,
    Bound<'py, PyArray3<bool>>,
    Bound<'py, PyArray1<i64>>,
);

/// `trees` padded to the largest (see `PyPruner::prune_batch`).
fn padded_to_py<'py>(py: Python<'py>, trees: &[DraftTree]) -> PyResult<PyPaddedTrees<'py>> {
    let (rows, width) = (
        trees.len(),
        trees.iter().map(DraftTree::len).max().unwrap_or(0),
    );
    let mut tokens = Array2::<i64>::zeros((rows, width));
    let mut parents = Array2::<i64>::zeros((rows, width));
    let mut depths = Array2::<i64>::zeros((rows, width));
    let mut mask = Array3::<bool>::from_elem((rows, width, width), false);
    for (b, tree) in trees.iter().enumerate() {
        let n = tree.len();
        for i in 0..n {
            tokens[(b, i)] = tree.tokens[i];
            parents[(b, i)] = tree.parents[i];
            depths[(b, i)] = tree.depths[i];
            for j in 0..n {
                mask[(b, i, j)] = tree.attention_mask[i * n + j];
            }
        }
        for i in n..width {
            mask[(b, i, i)] = true;
        }
    }
    let sizes: Vec<i64> = trees.iter().map(|t| t.len() as i64).collect();
    Ok((
        tokens.into_pyarray(py),
        parents.into_pyarray(py),
        depths.into_pyarray(py),
        mask.into_pyarray(py),
        PyArray1::from_vec(py, sizes),
    ))
}

/// int64 ids -> u32, each `< vocab_size`; `name(i)` names the element in the error.
fn ids_u32(v: &[i64], vocab_size: u32, name: impl Fn(usize) -> String) -> PyResult<Vec<u32>> {
    v.iter()
        .enumerate()
        .map(|(i, &x)| match u32::try_from(x) {
            Ok(t) if t < vocab_size => Ok(t),
            _ => Err(TokenOutOfVocabError::new_err(format!(
                "{} = {x} is outside the vocabulary (token ids must be < {vocab_size})",
                name(i)
            ))),
        })
        .collect()
}

fn contiguous<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    a: &'a numpy::PyReadonlyArray<'_, T, D>,
    what: &str,
) -> PyResult<&'a [T]> {
    c_order(a).ok_or_else(|| PrunerError::new_err(format!("{what} must be a C-contiguous array")))
}

fn non_negative(name: &str, v: i64) -> PyResult<usize> {
    usize::try_from(v)
        .map_err(|_| PrunerError::new_err(format!("{name} = {v}; expected a non-negative integer")))
}

/// A pruner over a mapped n-gram model (see `dart_client.ngram.pruner.Pruner`).
#[pyclass(name = "Pruner", module = "dart_client._native", frozen)]
pub struct PyPruner {
    /// Shared with the pool threads that help prune a batch ([`Pruner::prune_shared`]).
    inner: Arc<Pruner<Arc<NGramModel>>>,
}

#[pymethods]
impl PyPruner {
    /// `config`: the configuration as a dict (`dataclasses.asdict(PrunerConfig(...))`),
    /// deserialized into `dart_pruner::PrunerConfig` (see `config.rs`).
    #[new]
    fn new(ngram: PyRef<'_, PyNGram>, config: &Bound<'_, PyDict>) -> PyResult<Self> {
        let config = crate::config::pruner_config(config)?;
        let inner = Pruner::new(ngram.model(), config).map_err(to_py_err)?;
        Ok(PyPruner {
            inner: Arc::new(inner),
        })
    }

    /// How many trailing context tokens a request needs (the rest is never read).
    #[getter]
    fn context_tail_len(&self) -> usize {
        self.inner.context_tail_len()
    }

    /// The EOS token whose paths rank last in the beam (configured, else the model's).
    #[getter]
    fn eos_id(&self) -> Option<u32> {
        self.inner.eos_id()
    }

    /// `context` may be the tail of the caller's context: `context_offset` is the index of
    /// its first token there (for error messages).
    /// `lookup_path`: tokens after the root the tree must hold (see `DraftRequest`).
    #[pyo3(signature = (context, topk_ids, topk_probs, budget=None, context_offset=0,
                        lookup_path=None))]
    #[allow(clippy::too_many_arguments)]
    fn prune<'py>(
        &self,
        py: Python<'py>,
        context: PyReadonlyArray1<'py, i64>,
        topk_ids: PyReadonlyArray2<'py, i64>,
        topk_probs: PyReadonlyArray2<'py, f32>,
        budget: Option<i64>,
        context_offset: usize,
        lookup_path: Option<PyReadonlyArray1<'py, i64>>,
    ) -> PyResult<PyTree<'py>> {
        // A mapped model rewritten in place: a clear error, not its new bytes (or SIGBUS).
        self.inner.scorer().check_unchanged().map_err(to_py)?;
        let (levels, k) = (topk_ids.shape()[0], topk_ids.shape()[1]);
        if topk_probs.shape() != topk_ids.shape() {
            return Err(PrunerError::new_err(format!(
                "topk_ids has shape {:?} and topk_probs {:?}; expected the same (levels, k)",
                topk_ids.shape(),
                topk_probs.shape()
            )));
        }
        let budget = budget.map(|b| non_negative("budget", b)).transpose()?;
        let ctx = contiguous(&context, "context")?;
        let ids = contiguous(&topk_ids, "topk_ids")?;
        let probs = contiguous(&topk_probs, "topk_probs")?;
        let lookup = match &lookup_path {
            Some(a) => contiguous(a, "lookup_path")?,
            None => &[],
        };
        let vocab = self.inner.scorer().vocab_size();
        let tree = py.detach(|| -> PyResult<DraftTree> {
            let owned = OwnedRequest {
                context: ids_u32(ctx, vocab, |i| format!("context[{}]", context_offset + i))?,
                topk_ids: ids_u32(ids, vocab, |i| format!("topk_ids[{}][{}]", i / k, i % k))?,
                topk_probs: probs.to_vec(),
                levels,
                k,
                budget,
                lookup_path: ids_u32(lookup, vocab, |i| format!("lookup_path[{i}]"))?,
            };
            self.inner.prune(&owned.request()).map_err(to_py_err)
        })?;
        tree_to_py(py, tree)
    }

    /// Seconds taken by each of `repeats` prunes of one request, timed inside Rust with the
    /// GIL released: the baseline the Python call's overhead is measured against
    /// (`dart_client/apps/bench/pruner_overhead.py`).
    fn time_prune<'py>(
        &self,
        py: Python<'py>,
        context: PyReadonlyArray1<'py, i64>,
        topk_ids: PyReadonlyArray2<'py, i64>,
        topk_probs: PyReadonlyArray2<'py, f32>,
        repeats: usize,
    ) -> PyResult<Bound<'py, PyArray1<f64>>> {
        let (levels, k) = (topk_ids.shape()[0], topk_ids.shape()[1]);
        let ctx = contiguous(&context, "context")?;
        let ids = contiguous(&topk_ids, "topk_ids")?;
        let probs = contiguous(&topk_probs, "topk_probs")?;
        let vocab = self.inner.scorer().vocab_size();
        let times = py.detach(|| -> PyResult<Vec<f64>> {
            let owned = OwnedRequest {
                context: ids_u32(ctx, vocab, |i| format!("context[{i}]"))?,
                topk_ids: ids_u32(ids, vocab, |i| format!("topk_ids[{}][{}]", i / k, i % k))?,
                topk_probs: probs.to_vec(),
                levels,
                k,
                ..OwnedRequest::default()
            };
            let req = owned.request();
            (0..repeats)
                .map(|_| {
                    let start = std::time::Instant::now();
                    let tree = self.inner.prune(&req).map_err(to_py_err)?;
                    let t = start.elapsed().as_secs_f64();
                    drop(tree);
                    Ok(t)
                })
                .collect()
        })?;
        Ok(PyArray1::from_vec(py, times))
    }

    /// `context_offsets[b]` and `lookup_paths[b]`: as `context_offset` and `lookup_path` of
    /// `prune`, per request. With `padded`, the trees come back padded to the largest in one
    /// set of arrays (what a batched step verifies, without a Python object per tree):
    /// `(tokens, parents, depths, mask, sizes)`, `(B, S)` int64 each, `(B, S, S)` bool and
    /// `(B,)` int64, `S` the largest tree's size; row b's first `sizes[b]` nodes are its tree,
    /// and a padding node has token 0, parent 0 and depth 0 and sees only itself.
    #[pyo3(signature = (contexts, topk_ids, topk_probs, budgets=None, context_offsets=None,
                        lookup_paths=None, padded=false))]
    #[allow(clippy::too_many_arguments)]
    fn prune_batch<'py>(
        &self,
        py: Python<'py>,
        contexts: Vec<PyReadonlyArray1<'py, i64>>,
        topk_ids: PyReadonlyArray3<'py, i64>,
        topk_probs: PyReadonlyArray3<'py, f32>,
        budgets: Option<Vec<Option<i64>>>,
        context_offsets: Option<Vec<usize>>,
        lookup_paths: Option<Vec<Option<PyReadonlyArray1<'py, i64>>>>,
        padded: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.inner.scorer().check_unchanged().map_err(to_py)?;
        let shape = topk_ids.shape();
        let (batch, levels, k) = (shape[0], shape[1], shape[2]);
        if topk_probs.shape() != shape {
            return Err(PrunerError::new_err(format!(
                "topk_ids has shape {shape:?} and topk_probs {:?}; expected the same \
                 (batch, levels, k)",
                topk_probs.shape()
            )));
        }
        if contexts.len() != batch {
            return Err(PrunerError::new_err(format!(
                "{} contexts for a batch of {batch}; expected one context per request",
                contexts.len()
            )));
        }
        let budgets: Vec<Option<usize>> = match budgets {
            None => vec![None; batch],
            Some(b) if b.len() != batch => {
                return Err(PrunerError::new_err(format!(
                    "{} budgets for a batch of {batch}; expected one per request (or None)",
                    b.len()
                )))
            }
            Some(b) => b
                .into_iter()
                .enumerate()
                .map(|(i, x)| {
                    x.map(|v| non_negative(&format!("budgets[{i}]"), v))
                        .transpose()
                })
                .collect::<PyResult<_>>()?,
        };
        let ctxs: Vec<&[i64]> = contexts
            .iter()
            .enumerate()
            .map(|(i, c)| contiguous(c, &format!("contexts[{i}]")))
            .collect::<PyResult<_>>()?;
        let ids = contiguous(&topk_ids, "topk_ids")?;
        let probs = contiguous(&topk_probs, "topk_probs")?;
        let offsets = context_offsets.unwrap_or_else(|| vec![0; batch]);
        if offsets.len() != batch {
            return Err(PrunerError::new_err(format!(
                "{} context offsets for a batch of {batch}",
                offsets.len()
            )));
        }
        let lookup_paths = lookup_paths.unwrap_or_else(|| (0..batch).map(|_| None).collect());
        if lookup_paths.len() != batch {
            return Err(PrunerError::new_err(format!(
                "{} lookup paths for a batch of {batch}; expected one per request (or None)",
                lookup_paths.len()
            )));
        }
        let lookups: Vec<&[i64]> = lookup_paths
            .iter()
            .enumerate()
            .map(|(i, p)| match p {
                Some(a) => contiguous(a, &format!("lookup_paths[{i}]")),
                None => Ok(&[][..]),
            })
            .collect::<PyResult<_>>()?;
        let cells = levels * k;
        let vocab = self.inner.scorer().vocab_size();
        let trees = py.detach(|| -> PyResult<Vec<DraftTree>> {
            let owned: Vec<OwnedRequest> = (0..batch)
                .map(|b| {
                    let cells_of = b * cells..(b + 1) * cells;
                    Ok(OwnedRequest {
                        context: ids_u32(ctxs[b], vocab, |i| {
                            format!("contexts[{b}][{}]", offsets[b] + i)
                        })?,
                        topk_ids: ids_u32(&ids[cells_of.clone()], vocab, |i| {
                            format!("topk_ids[{b}][{}][{}]", i / k, i % k)
                        })?,
                        topk_probs: probs[cells_of].to_vec(),
                        levels,
                        k,
                        budget: budgets[b],
                        lookup_path: ids_u32(lookups[b], vocab, |i| {
                            format!("lookup_paths[{b}][{i}]")
                        })?,
                    })
                })
                .collect::<PyResult<_>>()?;
            // This thread is Python's, outside rayon's pool: it prunes alongside the pool
            // threads that wake in time instead of sleeping until they are done.
            self.inner
                .prune_shared(owned)
                .into_iter()
                .enumerate()
                .map(|(b, r)| {
                    r.map_err(|e| {
                        let err = to_py_err(e);
                        // Keep the exception's class; say which request failed.
                        Python::attach(|py| {
                            let msg = format!("request {b}: {}", err.value(py));
                            PyErr::from_type(err.get_type(py), msg)
                        })
                    })
                })
                .collect()
        })?;
        if padded {
            return Ok(padded_to_py(py, &trees)?.into_pyobject(py)?.into_any());
        }
        let trees: Vec<PyTree<'py>> = trees
            .into_iter()
            .map(|t| tree_to_py(py, t))
            .collect::<PyResult<_>>()?;
        Ok(trees.into_pyobject(py)?.into_any())
    }
}

/// `dart_pruner::PromptLookup`: an incremental prompt-lookup index over one sequence (see
/// `dart_client.decoding.lookup`).
#[pyclass(name = "PromptLookup", module = "dart_client._native")]
pub struct PyPromptLookup {
    inner: PromptLookup,
}

#[pymethods]
impl PyPromptLookup {
    #[new]
    #[pyo3(signature = (min_ngram=1, max_ngram=3))]
    fn new(min_ngram: usize, max_ngram: usize) -> PyResult<Self> {
        let inner = PromptLookup::new(min_ngram, max_ngram).map_err(to_py_err)?;
        Ok(PyPromptLookup { inner })
    }

    #[getter]
    fn min_ngram(&self) -> usize {
        self.inner.min_ngram()
    }

    #[getter]
    fn max_ngram(&self) -> usize {
        self.inner.max_ngram()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }

    fn clear(&mut self) {
        self.inner.clear();
    }

    /// Appends token ids (non-negative integers below 2^32).
    fn extend(&mut self, tokens: Vec<i64>) -> PyResult<()> {
        let ids = tokens
            .iter()
            .enumerate()
            .map(|(i, &t)| {
                u32::try_from(t).map_err(|_| {
                    TokenOutOfVocabError::new_err(format!(
                        "tokens[{i}] = {t} is not a token id (expected 0 <= id < 2^32)"
                    ))
                })
            })
            .collect::<PyResult<Vec<u32>>>()?;
        self.inner.extend(&ids);
        Ok(())
    }

    /// The continuation of the latest earlier match of the longest matching suffix, at most
    /// `max_tokens` ids (empty when nothing matches).
    fn propose(&self, max_tokens: usize) -> Vec<u32> {
        self.inner.propose(max_tokens).to_vec()
    }
}

/// The reference defaults, from the Rust side (the Python dataclass is tested against them).
#[pyfunction]
fn pruner_config_defaults(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    crate::config::pruner_config_dict(py, &PrunerConfig::default())
}

/// Draft rows as Python receives them: `(ids, probs)`.
type PyRows<'py> = (Bound<'py, PyArray2<i64>>, Bound<'py, PyArray2<f32>>);

/// `dart_pruner::top_k_rows`: the draft rows the pruner reads, from the head's logits.
///
/// `logits` is a C-contiguous `(rows, vocab)` array of float32, or of uint16 holding bf16 bits
/// (numpy has no bf16: `tensor.view(torch.int16).numpy().view(numpy.uint16)`);
/// `draft_to_target` (uint32, one entry per column) maps columns to target ids. Returns
/// `(ids int64 (rows, k), probs float32 (rows, k))`, each row best first.
#[pyfunction]
#[pyo3(signature = (logits, k, draft_to_target=None))]
fn top_k_rows<'py>(
    py: Python<'py>,
    logits: &Bound<'py, PyAny>,
    k: i64,
    draft_to_target: Option<PyReadonlyArray1<'py, u32>>,
) -> PyResult<PyRows<'py>> {
    let k = non_negative("k", k)?;
    let map = match &draft_to_target {
        Some(a) => Some(contiguous(a, "draft_to_target")?),
        None => None,
    };
    fn run<T: dart_pruner::Logit + numpy::Element>(
        a: &PyReadonlyArray2<'_, T>,
        k: usize,
        map: Option<&[u32]>,
    ) -> PyResult<(usize, dart_pruner::Result<dart_pruner::TopKRows>)> {
        let rows = a.shape()[0];
        Ok((
            rows,
            dart_pruner::top_k_rows(contiguous(a, "logits")?, rows, k, map),
        ))
    }
    let (rows, out) = if let Ok(a) = logits.extract::<PyReadonlyArray2<'py, f32>>() {
        run(&a, k, map)?
    } else if let Ok(a) = logits.extract::<PyReadonlyArray2<'py, u16>>() {
        run(&a, k, map)?
    } else {
        return Err(PrunerError::new_err(
            "logits must be a 2-D numpy array of float32, or of uint16 holding bf16 bits",
        ));
    };
    let out = out.map_err(to_py_err)?;
    let shape_err = |e: numpy::ndarray::ShapeError| PrunerError::new_err(e.to_string());
    let ids = out.ids.into_iter().map(i64::from).collect();
    Ok((
        Array2::from_shape_vec((rows, k), ids)
            .map_err(shape_err)?
            .into_pyarray(py),
        Array2::from_shape_vec((rows, k), out.probs)
            .map_err(shape_err)?
            .into_pyarray(py),
    ))
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPruner>()?;
    m.add_class::<PyPromptLookup>()?;
    m.add("PROMPT_LOOKUP_MAX_NGRAM", dart_pruner::lookup::MAX_NGRAM)?;
    m.add("PrunerError", m.py().get_type::<PrunerError>())?;
    m.add_function(wrap_pyfunction!(pruner_config_defaults, m)?)?;
    m.add_function(wrap_pyfunction!(top_k_rows, m)?)?;
    Ok(())
}
