//! The gRPC client of a `dart-ngram serve` daemon (`dart_client._native.DaemonClient`), under
//! `dart_client/ngram/remote.py`.
//!
//! Why native: a prune over loopback must cost little more than the prune itself. grpcio's
//! Python unary call alone takes ~0.15-0.2 ms per call on a loaded 2-core machine, about the
//! price of the prune; this client builds the protobuf messages from numpy arrays, runs the
//! call and turns the answer back into numpy arrays in Rust, with the GIL released.
//!
//! Each client owns a single-threaded tokio runtime and one HTTP/2 connection (the tonic
//! channel, which reconnects by itself after the daemon restarts). A call runs on the calling
//! thread: `block_on` drives the connection and the call together, so a round trip costs no
//! thread hand-off on this side. Several Python threads may call at once (tokio lets them
//! share the runtime's driver); their calls share the connection as HTTP/2 streams.
//!
//! Failures are `DaemonStatusError(code, details)`, `code` being the gRPC status code as an
//! int: `dart_client/ngram/remote.py` classifies them, retries the transient ones and raises its
//! exception family. Every call has a deadline (`timeout` seconds), enforced here and sent to
//! the daemon as `grpc-timeout`.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dart_daemon::proto;
use dart_daemon::proto::n_gram_service_client::NGramServiceClient;
use numpy::ndarray::{Array2, ArrayView, Dimension};
use numpy::{IntoPyArray, PyArray1, PyReadonlyArray, PyReadonlyArray1, PyUntypedArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use tonic::transport::{Channel, ClientTlsConfig, Endpoint};
use tonic::Code;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::arrays::c_order;
use crate::pruner::PyTree;

pyo3::create_exception!(
    dart_client._native,
    DaemonStatusError,
    pyo3::exceptions::PyException,
    "A call to the n-gram daemon failed: args are (gRPC status code as int, details). \
     dart_client.ngram.remote turns it into its DaemonError family."
);

fn status_err(code: Code, details: impl Into<String>) -> PyErr {
    DaemonStatusError::new_err((code as i32, details.into()))
}

fn status_to_py(status: &tonic::Status) -> PyErr {
    let mut details = status.message().to_string();
    if details.is_empty() {
        // Transport failures carry their cause as the source, not the message.
        if let Some(source) = std::error::Error::source(status) {
            details = source.to_string();
        }
    }
    status_err(status.code(), details)
}

/// The wire tree as numpy arrays, its shapes checked (a bad one is the daemon's fault).
fn tree_to_py(py: Python<'_>, t: proto::DraftTree) -> PyResult<PyTree<'_>> {
    let n = t.tokens.len();
    let (rows, cols) = (t.retrieve_rows as usize, t.retrieve_cols as usize);
    if t.parents.len() != n
        || t.depths.len() != n
        || t.scores.len() != n
        || t.attention_mask.len() != n * n
        || t.retrieve_indices.len() != rows * cols
    {
        return Err(status_err(
            Code::Internal,
            format!(
                "malformed tree from the daemon: {n} tokens, {} parents, {} depths, {} scores, \
                 {} mask bytes (expected {}), {} retrieve indices (expected {rows} x {cols})",
                t.parents.len(),
                t.depths.len(),
                t.scores.len(),
                t.attention_mask.len(),
                n * n,
                t.retrieve_indices.len()
            ),
        ));
    }
    let widen = |v: Vec<u32>| v.into_iter().map(i64::from).collect::<Vec<i64>>();
    let widen_signed = |v: Vec<i32>| v.into_iter().map(i64::from).collect::<Vec<i64>>();
    let mask: Vec<bool> = t.attention_mask.iter().map(|&b| b != 0).collect();
    let shape_err = |e: numpy::ndarray::ShapeError| status_err(Code::Internal, e.to_string());
    let mask = Array2::from_shape_vec((n, n), mask).map_err(shape_err)?;
    let retrieve = Array2::from_shape_vec((rows, cols), widen_signed(t.retrieve_indices))
        .map_err(shape_err)?;
    Ok((
        PyArray1::from_vec(py, widen(t.tokens)),
        PyArray1::from_vec(py, widen_signed(t.parents)),
        PyArray1::from_vec(py, widen(t.depths)),
        mask.into_pyarray(py),
        retrieve.into_pyarray(py),
        PyArray1::from_vec(py, t.scores),
    ))
}

/// Any numpy array's elements in row-major order.
fn flat<T: numpy::Element + Copy, D: Dimension>(a: &PyReadonlyArray<'_, T, D>) -> Vec<T> {
    match c_order(a) {
        Some(s) => s.to_vec(),
        None => {
            let view: ArrayView<'_, T, D> = a.as_array();
            view.iter().copied().collect()
        }
    }
}

/// int64 ids as the wire's u32; `name(i)` names element `i` (row-major) in the error, an
/// INVALID_ARGUMENT like the daemon's own (the daemon checks the vocabulary).
fn wire_ids<D: Dimension>(
    a: &PyReadonlyArray<'_, i64, D>,
    name: impl Fn(usize) -> String,
) -> PyResult<Vec<u32>> {
    let convert = |(i, &x): (usize, &i64)| {
        u32::try_from(x).map_err(|_| {
            status_err(
                Code::InvalidArgument,
                format!(
                    "{} = {x} is not a token id (expected 0 <= id < 2**32, and below the \
                     model's vocabulary size)",
                    name(i)
                ),
            )
        })
    };
    match c_order(a) {
        Some(s) => s.iter().enumerate().map(convert).collect(),
        None => a.as_array().iter().enumerate().map(convert).collect(),
    }
}

/// Ragged rows of int64 ids as the wire's `TokenRows`; errors name `what[row][col]`.
fn rows(
    tokens: &PyReadonlyArray1<'_, i64>,
    lengths: Vec<u32>,
    what: &str,
) -> PyResult<proto::TokenRows> {
    let tokens = wire_ids(tokens, |i| {
        let mut at = 0usize;
        for (row, &len) in lengths.iter().enumerate() {
            if i < at + len as usize {
                return format!("{what}[{row}][{}]", i - at);
            }
            at += len as usize;
        }
        format!("{what} token {i}")
    })?;
    Ok(proto::TokenRows { tokens, lengths })
}

fn deadline(timeout: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(timeout)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| PyValueError::new_err(format!("timeout = {timeout}; expected seconds > 0")))
}

/// What a call needs: the runtime that drives it, the connection it goes over, and how long
/// it polls for the answer before it sleeps (see [`spin_then_wait`]).
struct Conn {
    runtime: tokio::runtime::Runtime,
    channel: Channel,
    spin: Duration,
}

/// Awaits `fut`, first polling the connection without sleeping for up to `spin`.
///
/// A thread that sleeps in `epoll_wait` until the answer arrives pays for being woken up, and
/// on a virtual machine whose idle CPUs halt that costs 20-30 us per wake-up (a loopback
/// round trip between two sleeping threads measured 64 us on an idle 2-CPU VM, 20 us with one
/// side polling). While spinning, each round lets the runtime read the socket without
/// blocking, then yields the CPU to any other runnable thread (the daemon's, when both share
/// a CPU); several polling clients on few CPUs still slow the daemon down, hence off by
/// default (`dart_client.ngram.remote.DEFAULT_SPIN`).
async fn spin_then_wait<F: std::future::Future>(fut: F, spin: Duration) -> F::Output {
    use std::task::Poll;
    tokio::pin!(fut);
    if !spin.is_zero() {
        let until = Instant::now() + spin;
        loop {
            let polled = std::future::poll_fn(|cx| Poll::Ready(fut.as_mut().poll(cx))).await;
            if let Poll::Ready(out) = polled {
                return out;
            }
            if Instant::now() >= until {
                break;
            }
            // The runtime polls its I/O driver (without blocking) before resuming a yield.
            tokio::task::yield_now().await;
            std::thread::yield_now();
        }
    }
    fut.await
}

impl Conn {
    /// Runs one call to completion on this thread, within `timeout`.
    fn call<T, F, Fut>(&self, timeout: Duration, f: F) -> PyResult<T>
    where
        F: FnOnce(Channel) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let start = Instant::now();
        let fut = f(self.channel.clone());
        let late = || {
            status_err(
                Code::DeadlineExceeded,
                format!("no answer within {:.3} s", timeout.as_secs_f64()),
            )
        };
        self.runtime.block_on(async {
            match spin_then_wait(tokio::time::timeout(timeout, fut), self.spin).await {
                Ok(Ok(resp)) => Ok(resp.into_inner()),
                // The daemon enforces the deadline too (tonic answers CANCELLED then): past
                // it, any failure is the deadline's.
                Ok(Err(_)) if start.elapsed() >= timeout => Err(late()),
                Ok(Err(status)) => Err(status_to_py(&status)),
                Err(_) => Err(late()),
            }
        })
    }
}

/// The service's client over `ch`, with no message size limits of its own: requests are as
/// large as the caller made them (the daemon has --max-request-bytes), responses as large as
/// the request asked for.
fn service(ch: Channel) -> NGramServiceClient<Channel> {
    NGramServiceClient::new(ch)
        .max_decoding_message_size(usize::MAX)
        .max_encoding_message_size(usize::MAX)
}

fn request<T>(msg: T, timeout: Duration) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    req.set_timeout(timeout);
    req
}

/// Overrides of the daemon's pruner configuration, converted once per `RemotePruner`
/// (`None` keeps the daemon's default).
#[pyclass(name = "DaemonPrunerConfig", module = "dart_client._native", frozen)]
pub struct PyDaemonPrunerConfig {
    inner: proto::PrunerConfig,
}

#[pymethods]
impl PyDaemonPrunerConfig {
    /// `config`: the configuration as a dict (`dataclasses.asdict(PrunerConfig(...))`),
    /// deserialized into `dart_pruner::PrunerConfig` (see `config.rs`) and sent whole: every
    /// field overrides the daemon's default (`eos_id=None`: the model's EOS).
    #[new]
    fn new(config: &Bound<'_, pyo3::types::PyDict>) -> PyResult<Self> {
        let c = crate::config::pruner_config(config)?;
        let wire = |name: &str, v: usize| {
            u32::try_from(v).map_err(|_| {
                crate::pruner::PrunerError::new_err(format!(
                    "{name} = {v}; the daemon's protocol carries at most {}",
                    u32::MAX
                ))
            })
        };
        Ok(PyDaemonPrunerConfig {
            inner: proto::PrunerConfig {
                top_k: Some(wire("top_k", c.top_k)?),
                beam_width: Some(wire("beam_width", c.beam_width)?),
                max_nodes: Some(wire("max_nodes", c.max_nodes)?),
                level_exponent: Some(c.level_exponent),
                logit_decay: Some(c.logit_decay),
                ngram_weight: Some(c.ngram_weight),
                ngram_at_level0: Some(c.ngram_at_level0),
                eos_id: c.eos_id,
                eps: Some(c.eps),
            },
        })
    }
}

/// How often an idle connection is looked after (see [`idle_driver`]).
const IDLE_POLL: Duration = Duration::from_millis(20);

/// Drives the connection while no call does: a daemon that drains sends GOAWAY and a PING
/// and waits for the acknowledgement before it closes the connection, and a connection the
/// daemon closed is best noticed before the next call. Every `IDLE_POLL` this thread handles
/// whatever the socket has for it (one non-blocking pass of the runtime, microseconds; a call
/// that starts meanwhile takes the runtime over when the pass ends). It ends when the client
/// is closed or dropped.
fn idle_driver(conn: std::sync::Weak<Conn>, stop: std::sync::mpsc::Receiver<()>) {
    use std::sync::mpsc::RecvTimeoutError;
    while let Err(RecvTimeoutError::Timeout) = stop.recv_timeout(IDLE_POLL) {
        let Some(conn) = conn.upgrade() else { break };
        // A `yield_now` resumes only after the runtime has polled its I/O driver (without
        // blocking); the tasks that woke run at the next one, the writes they wake at the third.
        conn.runtime.block_on(async {
            for _ in 0..3 {
                tokio::task::yield_now().await;
            }
        });
    }
}

/// One connection to a daemon (see the module docs).
#[pyclass(name = "DaemonClient", module = "dart_client._native", frozen)]
pub struct PyDaemonClient {
    /// `None` once closed; calls in flight keep their own `Arc` until they return.
    conn: Mutex<Option<Arc<Conn>>>,
    /// Dropping it stops the idle driver.
    _stop_idle_driver: std::sync::mpsc::Sender<()>,
}

impl PyDaemonClient {
    fn conn(&self) -> PyResult<Arc<Conn>> {
        self.conn
            .lock()
            .map_err(|_| status_err(Code::Internal, "the client's lock is poisoned"))?
            .clone()
            .ok_or_else(|| status_err(Code::Cancelled, "the client is closed"))
    }
}

#[pymethods]
impl PyDaemonClient {
    /// Connects to `target` (`host:port`; TLS when `tls`), retrying refused connections until
    /// `timeout` seconds have passed (a daemon that is still starting gets that long). Each
    /// call polls for its answer for up to `spin` seconds before it sleeps (0: sleep at once).
    #[new]
    #[pyo3(signature = (target, *, tls, timeout, spin=0.0))]
    fn new(py: Python<'_>, target: &str, tls: bool, timeout: f64, spin: f64) -> PyResult<Self> {
        let timeout = deadline(timeout)?;
        let spin = Duration::try_from_secs_f64(spin)
            .ok()
            .filter(|d| *d <= Duration::from_secs(1))
            .ok_or_else(|| {
                PyValueError::new_err(format!("spin = {spin}; expected 0 <= seconds <= 1"))
            })?;
        let scheme = if tls { "https" } else { "http" };
        let mut endpoint = Endpoint::from_shared(format!("{scheme}://{target}"))
            .map_err(|e| PyValueError::new_err(format!("daemon address {target:?}: {e}")))?
            .tcp_nodelay(true)
            .connect_timeout(timeout);
        if tls {
            endpoint = endpoint
                .tls_config(ClientTlsConfig::new().with_enabled_roots())
                .map_err(|e| PyValueError::new_err(format!("TLS for {target:?}: {e}")))?;
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| status_err(Code::Internal, format!("cannot start a runtime: {e}")))?;
        let channel = py.detach(|| {
            runtime.block_on(async {
                let start = Instant::now();
                let mut pause = Duration::from_millis(10);
                loop {
                    match endpoint.connect().await {
                        Ok(channel) => return Ok(channel),
                        Err(err) => {
                            let left = timeout.saturating_sub(start.elapsed());
                            if left.is_zero() {
                                let cause = std::error::Error::source(&err)
                                    .map_or_else(|| err.to_string(), |s| s.to_string());
                                return Err(status_err(Code::Unavailable, cause));
                            }
                            tokio::time::sleep(pause.min(left)).await;
                            pause = (pause * 2).min(Duration::from_millis(200));
                        }
                    }
                }
            })
        })?;
        let conn = Arc::new(Conn {
            runtime,
            channel,
            spin,
        });
        let (stop_tx, stop_rx) = std::sync::mpsc::channel();
        let weak = Arc::downgrade(&conn);
        std::thread::Builder::new()
            .name("dart-daemon-client".into())
            .spawn(move || idle_driver(weak, stop_rx))
            .map_err(|e| status_err(Code::Internal, format!("cannot start a thread: {e}")))?;
        Ok(PyDaemonClient {
            conn: Mutex::new(Some(conn)),
            _stop_idle_driver: stop_tx,
        })
    }

    /// Closes the connection (once calls in flight return); further calls fail with
    /// CANCELLED.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let conn = self
            .conn
            .lock()
            .map_err(|_| status_err(Code::Internal, "the client's lock is poisoned"))?
            .take();
        // Dropping the runtime closes the socket; without the GIL, as it may wait a little.
        py.detach(move || drop(conn));
        Ok(())
    }

    /// `(order, vocab_size, tokenizer_fingerprint, eos_id, total_tokens, info_json,
    /// server_version)`.
    #[allow(clippy::type_complexity)]
    fn info<'py>(
        &self,
        py: Python<'py>,
        timeout: f64,
    ) -> PyResult<(
        u32,
        u32,
        Bound<'py, PyBytes>,
        Option<u32>,
        u64,
        String,
        String,
    )> {
        let (conn, t) = (self.conn()?, deadline(timeout)?);
        let r = py.detach(|| {
            conn.call(t, |ch| async move {
                service(ch).info(request(proto::InfoRequest {}, t)).await
            })
        })?;
        Ok((
            r.order,
            r.vocab_size,
            PyBytes::new(py, &r.tokenizer_fingerprint),
            r.eos_id,
            r.total_tokens,
            r.info_json,
            r.server_version,
        ))
    }

    /// The standard health check of `service` ("" = the whole server): the serving status as
    /// the protocol numbers it (1 = SERVING).
    fn health(&self, py: Python<'_>, service: String, timeout: f64) -> PyResult<i32> {
        let (conn, t) = (self.conn()?, deadline(timeout)?);
        let r = py.detach(|| {
            conn.call(t, |ch| async move {
                HealthClient::new(ch)
                    .check(request(HealthCheckRequest { service }, t))
                    .await
            })
        })?;
        Ok(r.status)
    }

    /// `P(c | context)` for ragged rows of contexts and candidates: `(probs, matched)`, flat.
    #[allow(clippy::type_complexity)]
    fn prob<'py>(
        &self,
        py: Python<'py>,
        ctx_tokens: PyReadonlyArray1<'py, i64>,
        ctx_lengths: Vec<u32>,
        cand_tokens: PyReadonlyArray1<'py, i64>,
        cand_lengths: Vec<u32>,
        timeout: f64,
    ) -> PyResult<(Bound<'py, PyArray1<f32>>, Bound<'py, PyArray1<u8>>)> {
        let (conn, t) = (self.conn()?, deadline(timeout)?);
        let req = proto::ProbRequest {
            contexts: Some(rows(&ctx_tokens, ctx_lengths, "contexts")?),
            candidates: Some(rows(&cand_tokens, cand_lengths, "candidates")?),
        };
        let r = py.detach(|| {
            conn.call(
                t,
                |ch| async move { service(ch).prob(request(req, t)).await },
            )
        })?;
        Ok((
            PyArray1::from_vec(py, r.probs),
            PyArray1::from_vec(py, r.matched),
        ))
    }

    /// Counts of ragged token rows.
    fn count<'py>(
        &self,
        py: Python<'py>,
        tokens: PyReadonlyArray1<'py, i64>,
        lengths: Vec<u32>,
        timeout: f64,
    ) -> PyResult<Bound<'py, PyArray1<u64>>> {
        let (conn, t) = (self.conn()?, deadline(timeout)?);
        let req = proto::CountRequest {
            sequences: Some(rows(&tokens, lengths, "sequences")?),
        };
        let r = py.detach(|| {
            conn.call(
                t,
                |ch| async move { service(ch).count(request(req, t)).await },
            )
        })?;
        Ok(PyArray1::from_vec(py, r.counts))
    }

    /// The `k` best continuations per ragged context row: `(ids, probs, lengths)`, flat.
    #[allow(clippy::type_complexity)]
    fn top_k<'py>(
        &self,
        py: Python<'py>,
        tokens: PyReadonlyArray1<'py, i64>,
        lengths: Vec<u32>,
        k: u32,
        timeout: f64,
    ) -> PyResult<(
        Bound<'py, PyArray1<i64>>,
        Bound<'py, PyArray1<f32>>,
        Bound<'py, PyArray1<u32>>,
    )> {
        let (conn, t) = (self.conn()?, deadline(timeout)?);
        let req = proto::TopKRequest {
            contexts: Some(rows(&tokens, lengths, "contexts")?),
            k,
        };
        let r = py.detach(|| {
            conn.call(
                t,
                |ch| async move { service(ch).top_k(request(req, t)).await },
            )
        })?;
        Ok((
            PyArray1::from_vec(py, r.ids.into_iter().map(i64::from).collect()),
            PyArray1::from_vec(py, r.probs),
            PyArray1::from_vec(py, r.lengths),
        ))
    }

    /// One draft tree: `context` (its tail), `topk_ids`/`topk_probs` of shape (levels, k),
    /// `lookup_path` the path the tree must hold (may be empty).
    #[pyo3(signature = (config, context, topk_ids, topk_probs, budget, timeout, lookup_path=None))]
    #[allow(clippy::too_many_arguments)]
    fn prune<'py>(
        &self,
        py: Python<'py>,
        config: &Bound<'py, PyDaemonPrunerConfig>,
        context: PyReadonlyArray1<'py, i64>,
        topk_ids: numpy::PyReadonlyArray2<'py, i64>,
        topk_probs: numpy::PyReadonlyArray2<'py, f32>,
        budget: Option<u32>,
        timeout: f64,
        lookup_path: Option<PyReadonlyArray1<'py, i64>>,
    ) -> PyResult<PyTree<'py>> {
        let (conn, t) = (self.conn()?, deadline(timeout)?);
        let req = proto::PruneRequest {
            draft: Some(draft(
                &context,
                &topk_ids,
                &topk_probs,
                budget,
                lookup_path.as_ref(),
            )?),
            config: Some(config.get().inner),
        };
        let r = py.detach(|| {
            conn.call(
                t,
                |ch| async move { service(ch).prune(request(req, t)).await },
            )
        })?;
        let tree = r
            .tree
            .ok_or_else(|| status_err(Code::Internal, "the daemon answered without a tree"))?;
        tree_to_py(py, tree)
    }

    /// Many trees in one call: `contexts` B tails, `topk_ids`/`topk_probs` (B, levels, k),
    /// `budgets` B values (or None), `lookup_paths` B paths (or None).
    #[pyo3(signature = (config, contexts, topk_ids, topk_probs, budgets, timeout,
                        lookup_paths=None))]
    #[allow(clippy::too_many_arguments)]
    fn prune_batch<'py>(
        &self,
        py: Python<'py>,
        config: &Bound<'py, PyDaemonPrunerConfig>,
        contexts: Vec<PyReadonlyArray1<'py, i64>>,
        topk_ids: numpy::PyReadonlyArray3<'py, i64>,
        topk_probs: numpy::PyReadonlyArray3<'py, f32>,
        budgets: Option<Vec<Option<u32>>>,
        timeout: f64,
        lookup_paths: Option<Vec<Option<PyReadonlyArray1<'py, i64>>>>,
    ) -> PyResult<Vec<PyTree<'py>>> {
        let (conn, t) = (self.conn()?, deadline(timeout)?);
        let shape = topk_ids.shape().to_vec();
        let batch = shape[0];
        if topk_probs.shape() != shape.as_slice() || contexts.len() != batch {
            return Err(PyValueError::new_err(format!(
                "{} contexts, topk_ids of shape {shape:?}, topk_probs of shape {:?}; expected \
                 one context per draft and the same (batch, levels, k) shapes",
                contexts.len(),
                topk_probs.shape()
            )));
        }
        if budgets.as_ref().is_some_and(|b| b.len() != batch) {
            return Err(PyValueError::new_err(format!(
                "budgets for {} drafts in a batch of {batch}",
                budgets.as_ref().map_or(0, Vec::len)
            )));
        }
        if lookup_paths.as_ref().is_some_and(|p| p.len() != batch) {
            return Err(PyValueError::new_err(format!(
                "lookup paths for {} drafts in a batch of {batch}",
                lookup_paths.as_ref().map_or(0, Vec::len)
            )));
        }
        let (levels, k) = (shape[1], shape[2]);
        let cells = levels * k;
        let ids = wire_ids(&topk_ids, |i| {
            format!("topk_ids[{}][{}][{}]", i / cells, i % cells / k, i % k)
        })?;
        let probs = flat(&topk_probs);
        let drafts = contexts
            .iter()
            .enumerate()
            .map(|(b, ctx)| {
                Ok(proto::Draft {
                    context: wire_ids(ctx, |i| format!("contexts[{b}] tail[{i}]"))?,
                    topk_ids: ids[b * cells..(b + 1) * cells].to_vec(),
                    topk_probs: probs[b * cells..(b + 1) * cells].to_vec(),
                    levels: wire_u32(levels, "levels")?,
                    k: wire_u32(k, "k")?,
                    budget: budgets.as_ref().and_then(|v| v[b]),
                    lookup_path: match lookup_paths.as_ref().and_then(|v| v[b].as_ref()) {
                        Some(p) => wire_ids(p, |i| format!("lookup_paths[{b}][{i}]"))?,
                        None => Vec::new(),
                    },
                })
            })
            .collect::<PyResult<Vec<_>>>()?;
        let req = proto::PruneBatchRequest {
            drafts,
            config: Some(config.get().inner),
        };
        let r = py.detach(|| {
            conn.call(t, |ch| async move {
                service(ch).prune_batch(request(req, t)).await
            })
        })?;
        if r.trees.len() != batch {
            return Err(status_err(
                Code::Internal,
                format!(
                    "the daemon answered {} trees for {batch} drafts",
                    r.trees.len()
                ),
            ));
        }
        r.trees.into_iter().map(|t| tree_to_py(py, t)).collect()
    }
}

fn wire_u32(v: usize, what: &str) -> PyResult<u32> {
    u32::try_from(v)
        .map_err(|_| PyValueError::new_err(format!("{what} = {v} does not fit 32 bits")))
}

fn draft(
    context: &PyReadonlyArray1<'_, i64>,
    topk_ids: &numpy::PyReadonlyArray2<'_, i64>,
    topk_probs: &numpy::PyReadonlyArray2<'_, f32>,
    budget: Option<u32>,
    lookup_path: Option<&PyReadonlyArray1<'_, i64>>,
) -> PyResult<proto::Draft> {
    if topk_ids.shape() != topk_probs.shape() {
        return Err(PyValueError::new_err(format!(
            "topk_ids has shape {:?} and topk_probs {:?}; expected the same (levels, k)",
            topk_ids.shape(),
            topk_probs.shape()
        )));
    }
    let k = topk_ids.shape()[1];
    Ok(proto::Draft {
        context: wire_ids(context, |i| format!("context tail[{i}]"))?,
        topk_ids: wire_ids(topk_ids, |i| format!("topk_ids[{}][{}]", i / k, i % k))?,
        topk_probs: flat(topk_probs),
        levels: wire_u32(topk_ids.shape()[0], "levels")?,
        k: wire_u32(topk_ids.shape()[1], "k")?,
        budget,
        lookup_path: match lookup_path {
            Some(p) => wire_ids(p, |i| format!("lookup_path[{i}]"))?,
            None => Vec::new(),
        },
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyDaemonClient>()?;
    m.add_class::<PyDaemonPrunerConfig>()?;
    m.add("DaemonStatusError", m.py().get_type::<DaemonStatusError>())?;
    Ok(())
}
