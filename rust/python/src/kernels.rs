//! The CPU decoding kernels of `dart_kernels`: `PackedMatrix` (the matmul behind
//! `dart_client.models.linear`), `tree_attention` (behind `dart_client.models.attention`) and
//! the element-wise `rms_norm`, `rotary`, `silu_mul` and the whole `decoder_layer` (behind
//! `dart_client.models.elementwise`).
//! bf16 crosses as its bits in uint16 arrays (numpy has no bf16:
//! `tensor.view(torch.uint16).numpy()`, no copy).

use dart_kernels::{Backend, CacheMut, DecoderLayer, PackedMatrix, View4};
use numpy::ndarray::IxDyn;
use numpy::{
    PyArray4, PyArrayDyn, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadonlyArray3,
    PyReadonlyArray4, PyReadonlyArrayDyn, PyReadwriteArray4, PyUntypedArrayMethods,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use crate::arrays::c_order;

pyo3::create_exception!(
    dart_client._native,
    KernelError,
    PyValueError,
    "A decoding-kernel call whose arrays do not fit (shape, dtype, layout)."
);

fn to_py_err(err: dart_kernels::KernelError) -> PyErr {
    KernelError::new_err(err.to_string())
}

/// An output array as a mutable slice: it must be C-contiguous (the kernels write it in order).
fn out_slice<'a, D: numpy::ndarray::Dimension>(
    out: &'a mut numpy::PyReadwriteArray<'_, u16, D>,
) -> PyResult<&'a mut [u16]> {
    if !out.is_c_contiguous() {
        return Err(KernelError::new_err("out must be a C-contiguous array"));
    }
    out.as_slice_mut()
        .map_err(|e| KernelError::new_err(e.to_string()))
}

fn slice<'a, T: numpy::Element, D: numpy::ndarray::Dimension>(
    a: &'a numpy::PyReadonlyArray<'_, T, D>,
    what: &str,
) -> PyResult<&'a [T]> {
    c_order(a).ok_or_else(|| KernelError::new_err(format!("{what} must be a C-contiguous array")))
}

/// A bf16 weight matrix `(out_features, in_features)` packed for the decoding matmul.
#[pyclass(name = "PackedMatrix", module = "dart_client._native", frozen)]
pub struct PyPackedMatrix {
    inner: PackedMatrix,
}

#[pymethods]
impl PyPackedMatrix {
    /// Packs `weight`, a C-contiguous uint16 array of bf16 bits, shape `(out, in)`.
    #[new]
    fn new(py: Python<'_>, weight: PyReadonlyArray2<'_, u16>) -> PyResult<Self> {
        let (n, k) = (weight.shape()[0], weight.shape()[1]);
        let w = slice(&weight, "weight")?;
        let inner = py
            .detach(|| PackedMatrix::pack(w, n, k))
            .map_err(to_py_err)?;
        Ok(Self { inner })
    }

    #[getter]
    fn out_features(&self) -> usize {
        self.inner.out_features()
    }

    #[getter]
    fn in_features(&self) -> usize {
        self.inner.in_features()
    }

    /// Bytes of the packed copy.
    #[getter]
    fn packed_bytes(&self) -> usize {
        self.inner.packed_bytes()
    }

    /// `x @ weight.T + bias`, `x` `(..., in)`, into `out` `(..., out)` when given, else into
    /// a new array; returns it. `bias` `(out,)`; all uint16 bf16 bits, C-contiguous.
    /// `backend`: "auto", "amx", "avx512bf16", "avx512", "avx2" or "scalar".
    #[pyo3(signature = (x, out=None, bias=None, threads=1, backend="auto"))]
    fn matmul<'py>(
        &self,
        py: Python<'py>,
        x: PyReadonlyArrayDyn<'py, u16>,
        out: Option<Bound<'py, PyArrayDyn<u16>>>,
        bias: Option<PyReadonlyArray1<'py, u16>>,
        threads: usize,
        backend: &str,
    ) -> PyResult<Bound<'py, PyArrayDyn<u16>>> {
        let Some(backend) = Backend::from_name(backend) else {
            let names: Vec<&str> = Backend::ALL.iter().map(|b| b.name()).collect();
            return Err(KernelError::new_err(format!(
                "backend {backend:?}; expected one of {names:?}"
            )));
        };
        let Some((&columns, leading)) = x.shape().split_last() else {
            return Err(KernelError::new_err("x has no dimensions"));
        };
        if columns != self.inner.in_features() {
            return Err(KernelError::new_err(format!(
                "x has {columns} columns, the matrix {} inputs",
                self.inner.in_features()
            )));
        }
        let rows = leading.iter().product::<usize>();
        let mut shape = leading.to_vec();
        shape.push(self.inner.out_features());
        let out = output(py, out, &shape)?;
        let x = slice(&x, "x")?;
        let bias = match &bias {
            Some(b) => Some(slice(b, "bias")?),
            None => None,
        };
        {
            let mut written = writable("out", &out)?;
            let out = out_slice(&mut written)?;
            let inner = &self.inner;
            if threads <= 1 && rows <= 2 {
                // A decoding step's matmul takes ~20-100 us: releasing the GIL would add ~1%.
                inner.matmul_with(backend, x, rows, bias, out, 1)
            } else {
                py.detach(|| inner.matmul_with(backend, x, rows, bias, out, threads))
            }
            .map_err(to_py_err)?;
        }
        Ok(out)
    }
}

/// An array borrowed for writing: an error naming it for a read-only array or one borrowed
/// elsewhere (numpy's own extraction would panic).
fn writable<'py, D: numpy::ndarray::Dimension>(
    what: &str,
    a: &Bound<'py, numpy::PyArray<u16, D>>,
) -> PyResult<numpy::PyReadwriteArray<'py, u16, D>> {
    a.try_readwrite()
        .map_err(|e| KernelError::new_err(format!("{what} cannot be written: {e}")))
}

/// The caller's output array, checked against `shape`, or a new one of that shape (its
/// contents uninitialised: every kernel writes each element of its output).
fn output<'py>(
    py: Python<'py>,
    out: Option<Bound<'py, PyArrayDyn<u16>>>,
    shape: &[usize],
) -> PyResult<Bound<'py, PyArrayDyn<u16>>> {
    match out {
        Some(out) if out.shape() != shape => Err(KernelError::new_err(format!(
            "out has shape {:?}, expected {shape:?}",
            out.shape()
        ))),
        Some(out) => Ok(out),
        // SAFETY: the array is handed out only after a kernel wrote all of it (the callers
        // return it on success only).
        None => Ok(unsafe { PyArrayDyn::<u16>::new(py, IxDyn(shape), false) }),
    }
}

/// A numpy array of bf16 bits as a kernel view: any non-negative strides, the last
/// dimension contiguous (checked by `View4::new`).
fn view4<'a>(what: &'static str, a: &'a PyReadonlyArray4<'_, u16>) -> PyResult<View4<'a>> {
    let shape = [a.shape()[0], a.shape()[1], a.shape()[2], a.shape()[3]];
    let (strides, span) = strides_and_span(what, shape, a.strides())?;
    // SAFETY: every element of the array lies in [ptr, ptr + span) (non-negative strides),
    // and the array stays borrowed (read-only) for 'a.
    let data = unsafe { std::slice::from_raw_parts(a.as_array().as_ptr(), span) };
    View4::new(what, data, shape, strides).map_err(to_py_err)
}

/// `dart_kernels::attention`: `softmax(q k^T * scale + mask) v` into `out` `(b, n, h, d)`
/// (C-contiguous); `query` `(b, h, n, d)`, `key`/`value` `(b, kv, L, d)`, `mask` `(1|b, 1|h,
/// n, >= L)` or None (causal), all uint16 bf16 bits with a contiguous last dimension.
#[pyfunction]
#[pyo3(signature = (query, key, value, out, mask=None, scale=1.0, threads=1))]
#[allow(clippy::too_many_arguments)]
fn tree_attention(
    py: Python<'_>,
    query: PyReadonlyArray4<'_, u16>,
    key: PyReadonlyArray4<'_, u16>,
    value: PyReadonlyArray4<'_, u16>,
    out: Bound<'_, PyArray4<u16>>,
    mask: Option<PyReadonlyArray4<'_, u16>>,
    scale: f32,
    threads: usize,
) -> PyResult<()> {
    let (q, k, v) = (
        view4("query", &query)?,
        view4("key", &key)?,
        view4("value", &value)?,
    );
    let m = match &mask {
        Some(m) => Some(view4("mask", m)?),
        None => None,
    };
    let [b, h, n, d] = q.shape();
    if out.shape() != [b, n, h, d] {
        return Err(KernelError::new_err(format!(
            "out has shape {:?}, expected [{b}, {n}, {h}, {d}]",
            out.shape()
        )));
    }
    let mut out = writable("out", &out)?;
    let out = out_slice(&mut out)?;
    let m = m.as_ref();
    if threads <= 1 {
        dart_kernels::attention(&q, &k, &v, m, scale, out, threads)
    } else {
        py.detach(|| dart_kernels::attention(&q, &k, &v, m, scale, out, threads))
    }
    .map_err(to_py_err)
}

/// A 4-D array's strides in elements (bf16: 2 bytes), 0 for dimensions of size 1, and the
/// number of elements its last element lies from its first (+1): what a view spans.
fn strides_and_span(
    what: &str,
    shape: [usize; 4],
    strides: &[isize],
) -> PyResult<([usize; 4], usize)> {
    let mut out = [0usize; 4];
    for (dst, (&bytes, &n)) in out.iter_mut().zip(strides.iter().zip(&shape)) {
        if bytes < 0 || bytes % 2 != 0 {
            return Err(KernelError::new_err(format!(
                "{what} has a negative or odd stride ({bytes} bytes)"
            )));
        }
        // A dimension of size 1 may carry any stride (numpy and torch both write 0 or junk).
        *dst = if n == 1 { 0 } else { bytes as usize / 2 };
    }
    if shape.contains(&0) {
        return Err(KernelError::new_err(format!(
            "{what} has an empty dimension"
        )));
    }
    let span = shape
        .iter()
        .zip(&out)
        .map(|(&n, &s)| (n - 1) * s)
        .sum::<usize>()
        + 1;
    Ok((out, span))
}

/// A writable numpy array of bf16 bits as a cache the layer writes: any non-negative
/// strides, the last dimension contiguous (checked by `CacheMut::new`).
fn cache_mut<'a>(
    what: &'static str,
    a: &'a mut PyReadwriteArray4<'_, u16>,
) -> PyResult<CacheMut<'a>> {
    let shape = [a.shape()[0], a.shape()[1], a.shape()[2], a.shape()[3]];
    let (strides, span) = strides_and_span(what, shape, a.strides())?;
    // SAFETY: every element of the array lies in [ptr, ptr + span) (non-negative strides),
    // and the array stays borrowed for writing (numpy's borrow tracking: no other view of it
    // is borrowed meanwhile) for 'a.
    let data = unsafe { std::slice::from_raw_parts_mut(a.as_array_mut().as_mut_ptr(), span) };
    CacheMut::new(what, data, shape, strides).map_err(to_py_err)
}

/// `dart_kernels::DecoderLayer::forward`: a Llama decoder layer on `hidden` `(batch, tokens,
/// hidden)` in one call, with the bits of its kernels called one by one. `qkv` and `gate_up`
/// are the stacked projections (q, k, v rows; gate, up rows), `cos`/`sin` `(batch, tokens,
/// head_dim)`; the new keys and values go to positions `start..start + tokens` of `keys` /
/// `values` `(batch, kv_heads, capacity, head_dim)` (written in place), and the queries see
/// their first `start + tokens` positions through `mask` (as `tree_attention` takes it) or
/// causally. Returns the layer's output `(batch, tokens, hidden)`. All uint16 bf16 bits.
/// With `normed` `(batch, tokens, q/k/v inputs)`, the caller applied the input norm: q/k/v
/// multiply `normed` and the attention's output is added to `hidden`
/// (`DecoderLayer::forward_normed`, a DART draft head's layer; `input_norm` is then None).
#[pyfunction]
#[pyo3(signature = (
    hidden, input_norm, post_attention_norm, eps, qkv, o, gate_up, down, heads, kv_heads,
    scale, cos, sin, keys, values, start, mask=None, threads=1, normed=None
))]
#[allow(clippy::too_many_arguments)]
fn decoder_layer<'py>(
    py: Python<'py>,
    hidden: PyReadonlyArray3<'py, u16>,
    input_norm: Option<PyReadonlyArray1<'py, u16>>,
    post_attention_norm: PyReadonlyArray1<'py, u16>,
    eps: f32,
    qkv: PyRef<'py, PyPackedMatrix>,
    o: PyRef<'py, PyPackedMatrix>,
    gate_up: PyRef<'py, PyPackedMatrix>,
    down: PyRef<'py, PyPackedMatrix>,
    heads: usize,
    kv_heads: usize,
    scale: f32,
    cos: PyReadonlyArray3<'py, u16>,
    sin: PyReadonlyArray3<'py, u16>,
    keys: Bound<'py, PyArray4<u16>>,
    values: Bound<'py, PyArray4<u16>>,
    start: usize,
    mask: Option<PyReadonlyArray4<'py, u16>>,
    threads: usize,
    normed: Option<PyReadonlyArray3<'py, u16>>,
) -> PyResult<Bound<'py, PyArrayDyn<u16>>> {
    let [batch, tokens, _] = [hidden.shape()[0], hidden.shape()[1], hidden.shape()[2]];
    let [cb, ct, head_dim] = [cos.shape()[0], cos.shape()[1], cos.shape()[2]];
    if (cb, ct) != (batch, tokens) || sin.shape() != cos.shape() {
        return Err(KernelError::new_err(format!(
            "cos/sin have shapes {:?}/{:?}, expected ({batch}, {tokens}, head_dim)",
            cos.shape(),
            sin.shape()
        )));
    }
    let layer = DecoderLayer {
        input_norm: match (&input_norm, &normed) {
            (Some(norm), None) => slice(norm, "input_norm")?,
            (None, Some(_)) => &[],
            _ => {
                return Err(KernelError::new_err(
                    "give input_norm, or normed (an input already normed), not both",
                ))
            }
        },
        post_attention_norm: slice(&post_attention_norm, "post_attention_norm")?,
        eps,
        qkv: &qkv.inner,
        o: &o.inner,
        gate_up: &gate_up.inner,
        down: &down.inner,
        heads,
        kv_heads,
        head_dim,
        scale,
    };
    let out = output(py, None, hidden.shape())?;
    let (x, cos, sin) = (
        slice(&hidden, "hidden")?,
        slice(&cos, "cos")?,
        slice(&sin, "sin")?,
    );
    let (mut keys, mut values) = (writable("keys", &keys)?, writable("values", &values)?);
    let mut keys = cache_mut("keys", &mut keys)?;
    let mut values = cache_mut("values", &mut values)?;
    let mask = match &mask {
        Some(m) => Some(view4("mask", m)?),
        None => None,
    };
    let normed = match &normed {
        Some(n) if n.shape()[..2] != [batch, tokens] => {
            return Err(KernelError::new_err(format!(
                "normed has shape {:?}, expected ({batch}, {tokens}, q/k/v inputs)",
                n.shape()
            )))
        }
        Some(n) => Some(slice(n, "normed")?),
        None => None,
    };
    {
        let mut written = writable("out", &out)?;
        let out = out_slice(&mut written)?;
        let threads = threads.max(1);
        let (keys, values, mask) = (&mut keys, &mut values, mask.as_ref());
        // A layer takes about a millisecond: other Python threads (a server's) run meanwhile.
        py.detach(|| match normed {
            Some(normed) => layer.forward_normed(
                normed, x, batch, tokens, cos, sin, keys, values, start, mask, out, threads,
            ),
            None => layer.forward(
                x, batch, tokens, cos, sin, keys, values, start, mask, out, threads,
            ),
        })
        .map_err(to_py_err)?;
    }
    Ok(out)
}

/// `dart_kernels::rms_norm`: `weight * bf16(x * rsqrt(mean(x^2) + eps))` over the last
/// dimension of `x` (any shape ending in the weight's length), into `out` (x's shape) or a
/// new array; returns it. uint16 bf16 bits, C-contiguous.
#[pyfunction]
#[pyo3(signature = (x, weight, eps, out=None))]
fn rms_norm<'py>(
    py: Python<'py>,
    x: PyReadonlyArrayDyn<'py, u16>,
    weight: PyReadonlyArray1<'py, u16>,
    eps: f32,
    out: Option<Bound<'py, PyArrayDyn<u16>>>,
) -> PyResult<Bound<'py, PyArrayDyn<u16>>> {
    let out = output(py, out, x.shape())?;
    let (x, weight) = (slice(&x, "x")?, slice(&weight, "weight")?);
    dart_kernels::rms_norm(x, weight, eps, out_slice(&mut writable("out", &out)?)?)
        .map_err(to_py_err)?;
    Ok(out)
}

/// `dart_kernels::rotary`: transformers' `x * cos + rotate_half(x) * sin` in bf16; `x`
/// `(tokens, heads, dim)`, `cos` and `sin` `(tokens, dim)` (any leading shape that flattens
/// to those), into `out` (x's shape) or a new array; returns it. uint16 bf16 bits,
/// C-contiguous.
#[pyfunction]
#[pyo3(signature = (x, cos, sin, out=None))]
fn rotary<'py>(
    py: Python<'py>,
    x: PyReadonlyArrayDyn<'py, u16>,
    cos: PyReadonlyArrayDyn<'py, u16>,
    sin: PyReadonlyArrayDyn<'py, u16>,
    out: Option<Bound<'py, PyArrayDyn<u16>>>,
) -> PyResult<Bound<'py, PyArrayDyn<u16>>> {
    let dim = *cos
        .shape()
        .last()
        .ok_or_else(|| KernelError::new_err("cos has no dimensions"))?;
    let out = output(py, out, x.shape())?;
    let (x, cos, sin) = (slice(&x, "x")?, slice(&cos, "cos")?, slice(&sin, "sin")?);
    dart_kernels::rotary(x, cos, sin, dim, out_slice(&mut writable("out", &out)?)?)
        .map_err(to_py_err)?;
    Ok(out)
}

/// `dart_kernels::silu_mul`: `silu(gate) * up` rounded as bf16 operations round, into `out`
/// (gate's shape) or a new array; returns it. uint16 bf16 bits of one length, C-contiguous.
#[pyfunction]
#[pyo3(signature = (gate, up, out=None))]
fn silu_mul<'py>(
    py: Python<'py>,
    gate: PyReadonlyArrayDyn<'py, u16>,
    up: PyReadonlyArrayDyn<'py, u16>,
    out: Option<Bound<'py, PyArrayDyn<u16>>>,
) -> PyResult<Bound<'py, PyArrayDyn<u16>>> {
    let out = output(py, out, gate.shape())?;
    let (gate, up) = (slice(&gate, "gate")?, slice(&up, "up")?);
    dart_kernels::silu_mul(gate, up, out_slice(&mut writable("out", &out)?)?).map_err(to_py_err)?;
    Ok(out)
}

/// Whether a SIMD decoding kernel runs on this CPU (AMX, AVX-512F/BW/VL, or AVX2 with FMA);
/// without one the scalar kernel gives the same bits, far slower, and `dart_client` keeps
/// PyTorch's kernels.
/// An invalid `DART_MAX_CPU_ISA` is an error here (`dart_client` asks at import).
#[pyfunction]
fn decoding_matmul_simd() -> PyResult<bool> {
    Backend::max_isa().map_err(to_py_err)?;
    Ok(Backend::any_simd_available())
}

/// The kernel `PackedMatrix.matmul(backend="auto")` runs on this CPU: "amx", "avx512bf16",
/// "avx512", "avx2" or "scalar" (the best it has, at most what `DART_MAX_CPU_ISA` names).
#[pyfunction]
fn decoding_matmul_backend() -> PyResult<&'static str> {
    Backend::max_isa().map_err(to_py_err)?;
    Ok(Backend::best().name())
}

/// Every kernel this CPU runs, the most capable first ("scalar" last), whatever
/// `DART_MAX_CPU_ISA` says: what `PackedMatrix.matmul(backend=...)` accepts here.
#[pyfunction]
fn decoding_matmul_backends() -> Vec<&'static str> {
    Backend::runnable().into_iter().map(Backend::name).collect()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyPackedMatrix>()?;
    m.add("KernelError", m.py().get_type::<KernelError>())?;
    m.add_function(wrap_pyfunction!(decoding_matmul_simd, m)?)?;
    m.add_function(wrap_pyfunction!(decoding_matmul_backend, m)?)?;
    m.add_function(wrap_pyfunction!(decoding_matmul_backends, m)?)?;
    m.add_function(wrap_pyfunction!(tree_attention, m)?)?;
    m.add_function(wrap_pyfunction!(decoder_layer, m)?)?;
    m.add_function(wrap_pyfunction!(rms_norm, m)?)?;
    m.add_function(wrap_pyfunction!(rotary, m)?)?;
    m.add_function(wrap_pyfunction!(silu_mul, m)?)?;
    Ok(())
}
