//! Prometheus metrics: requests and errors by method and status code, latency histograms per
//! method, requests in flight; served as text exposition format 0.0.4 on `--metrics-listen`.
//!
//! Lock-free atomics in fixed tables (the methods are known at compile time), so recording a
//! request costs a few atomic adds and no allocation on the hot path.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// The gRPC methods served, as they appear in request paths, plus a catch-all.
pub const METHODS: [&str; 9] = [
    "/dart.ngram.v1.NGramService/Info",
    "/dart.ngram.v1.NGramService/Prob",
    "/dart.ngram.v1.NGramService/Count",
    "/dart.ngram.v1.NGramService/TopK",
    "/dart.ngram.v1.NGramService/Prune",
    "/dart.ngram.v1.NGramService/PruneBatch",
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "other",
];
const OTHER: usize = METHODS.len() - 1;

/// gRPC status code names, indexed by code.
pub const CODES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

/// Histogram bucket upper bounds in seconds: 25 us to 2.5 s, roughly x2.5 apart.
pub const BUCKETS: [f64; 14] = [
    25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1, 0.5, 2.5,
];

struct MethodStats {
    by_code: [AtomicU64; CODES.len()],
    // Cumulative form is computed at render time; these are per-bucket counts (+Inf last).
    buckets: [AtomicU64; BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
}

impl MethodStats {
    fn new() -> Self {
        MethodStats {
            by_code: std::array::from_fn(|_| AtomicU64::new(0)),
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            sum_nanos: AtomicU64::new(0),
        }
    }
}

/// The daemon's metrics registry.
pub struct Metrics {
    methods: [MethodStats; METHODS.len()],
    in_flight: AtomicI64,
    started: Instant,
    model_bytes: AtomicU64,
    cancelled_work: AtomicU64,
    connections_open: AtomicI64,
    connections_refused: AtomicU64,
    connections_timed_out: AtomicU64,
    reloads: [AtomicU64; 2],
    /// Bytes of the served model in the page cache, asked at render time (`None`: unknown).
    resident_probe: OnceLock<ResidentProbe>,
}

/// Reads how much of the served model is resident (a `mincore` over its mapping).
pub type ResidentProbe = Box<dyn Fn() -> Option<u64> + Send + Sync>;

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        Metrics {
            methods: std::array::from_fn(|_| MethodStats::new()),
            in_flight: AtomicI64::new(0),
            started: Instant::now(),
            model_bytes: AtomicU64::new(0),
            cancelled_work: AtomicU64::new(0),
            connections_open: AtomicI64::new(0),
            connections_refused: AtomicU64::new(0),
            connections_timed_out: AtomicU64::new(0),
            reloads: [AtomicU64::new(0), AtomicU64::new(0)],
            resident_probe: OnceLock::new(),
        }
    }

    /// Sets how `dart_ngram_model_resident_bytes` is read (once; later calls are ignored).
    pub fn set_resident_probe(&self, probe: ResidentProbe) {
        let _ = self.resident_probe.set(probe);
    }

    /// The index of a request path in [`METHODS`] (unknown paths share the "other" row).
    pub fn method_index(path: &str) -> usize {
        METHODS[..OTHER]
            .iter()
            .position(|m| *m == path)
            .unwrap_or(OTHER)
    }

    /// Requests being handled now.
    pub fn in_flight(&self) -> i64 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Drafts left unpruned because their client went away or their deadline passed.
    pub fn add_cancelled_work(&self, drafts: u64) {
        self.cancelled_work.fetch_add(drafts, Ordering::Relaxed);
    }

    pub fn cancelled_work(&self) -> u64 {
        self.cancelled_work.load(Ordering::Relaxed)
    }

    /// A connection accepted (+1) or closed (-1).
    pub fn connection_opened(&self, delta: i64) {
        self.connections_open.fetch_add(delta, Ordering::Relaxed);
    }

    pub fn connections_open(&self) -> i64 {
        self.connections_open.load(Ordering::Relaxed)
    }

    /// A connection closed at accept because `--max-connections` were open.
    pub fn connection_refused(&self) -> u64 {
        self.connections_refused.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// A connection closed for sending nothing within the handshake or idle timeout.
    pub fn connection_timed_out(&self) {
        self.connections_timed_out.fetch_add(1, Ordering::Relaxed);
    }

    pub fn connections_timed_out(&self) -> u64 {
        self.connections_timed_out.load(Ordering::Relaxed)
    }

    /// A reload on SIGHUP that succeeded or was refused.
    pub fn reloaded(&self, ok: bool) {
        self.reloads[usize::from(!ok)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn set_model_bytes(&self, bytes: u64) {
        self.model_bytes.store(bytes, Ordering::Relaxed);
    }

    /// Marks a request started; the guard records it when dropped (so a request whose client
    /// went away is still accounted, as CANCELLED unless a status was set).
    pub fn start(self: &Arc<Self>, method: usize) -> RequestGuard {
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        RequestGuard {
            metrics: Arc::clone(self),
            method,
            started: Instant::now(),
            code: None,
        }
    }

    fn record(&self, method: usize, code: usize, elapsed: Duration) {
        let stats = &self.methods[method.min(OTHER)];
        stats.by_code[code.min(CODES.len() - 1)].fetch_add(1, Ordering::Relaxed);
        let secs = elapsed.as_secs_f64();
        let bucket = BUCKETS
            .iter()
            .position(|&b| secs <= b)
            .unwrap_or(BUCKETS.len());
        stats.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        stats.sum_nanos.fetch_add(
            elapsed.as_nanos().min(u64::MAX as u128) as u64,
            Ordering::Relaxed,
        );
    }

    /// Requests recorded for a method and code (tests, logs).
    pub fn requests(&self, method: &str, code: usize) -> u64 {
        self.methods[Self::method_index(method)].by_code[code].load(Ordering::Relaxed)
    }

    /// The text exposition of every metric.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(8192);
        out.push_str(
            "# HELP dart_ngram_requests_total gRPC requests handled, by method and status code.\n",
        );
        out.push_str("# TYPE dart_ngram_requests_total counter\n");
        for (m, stats) in self.methods.iter().enumerate() {
            for (c, n) in stats.by_code.iter().enumerate() {
                let n = n.load(Ordering::Relaxed);
                if n > 0 {
                    let _ = writeln!(
                        out,
                        "dart_ngram_requests_total{{method=\"{}\",code=\"{}\"}} {n}",
                        METHODS[m], CODES[c]
                    );
                }
            }
        }
        out.push_str("# HELP dart_ngram_errors_total gRPC requests that ended with a status other than OK.\n");
        out.push_str("# TYPE dart_ngram_errors_total counter\n");
        for (m, stats) in self.methods.iter().enumerate() {
            for (c, n) in stats.by_code.iter().enumerate().skip(1) {
                let n = n.load(Ordering::Relaxed);
                if n > 0 {
                    let _ = writeln!(
                        out,
                        "dart_ngram_errors_total{{method=\"{}\",code=\"{}\"}} {n}",
                        METHODS[m], CODES[c]
                    );
                }
            }
        }
        out.push_str("# HELP dart_ngram_request_duration_seconds Time from request headers to response headers.\n");
        out.push_str("# TYPE dart_ngram_request_duration_seconds histogram\n");
        for (m, stats) in self.methods.iter().enumerate() {
            let counts: Vec<u64> = stats
                .buckets
                .iter()
                .map(|b| b.load(Ordering::Relaxed))
                .collect();
            let total: u64 = counts.iter().sum();
            if total == 0 {
                continue;
            }
            let mut cumulative = 0;
            for (i, bound) in BUCKETS.iter().enumerate() {
                cumulative += counts[i];
                let _ = writeln!(
                    out,
                    "dart_ngram_request_duration_seconds_bucket{{method=\"{}\",le=\"{bound}\"}} {cumulative}",
                    METHODS[m]
                );
            }
            let _ = writeln!(
                out,
                "dart_ngram_request_duration_seconds_bucket{{method=\"{}\",le=\"+Inf\"}} {total}",
                METHODS[m]
            );
            let _ = writeln!(
                out,
                "dart_ngram_request_duration_seconds_sum{{method=\"{}\"}} {}",
                METHODS[m],
                stats.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9
            );
            let _ = writeln!(
                out,
                "dart_ngram_request_duration_seconds_count{{method=\"{}\"}} {total}",
                METHODS[m]
            );
        }
        out.push_str("# HELP dart_ngram_in_flight_requests Requests being handled now.\n");
        out.push_str("# TYPE dart_ngram_in_flight_requests gauge\n");
        let _ = writeln!(
            out,
            "dart_ngram_in_flight_requests {}",
            self.in_flight.load(Ordering::Relaxed)
        );
        let counters: [(&str, &str, &str, u64); 5] = [
            (
                "dart_ngram_cancelled_work_total",
                "Drafts of batches left unpruned because the client went away or the deadline passed.",
                "",
                self.cancelled_work.load(Ordering::Relaxed),
            ),
            (
                "dart_ngram_connections_refused_total",
                "Connections closed at accept because --max-connections were open.",
                "",
                self.connections_refused.load(Ordering::Relaxed),
            ),
            (
                "dart_ngram_connections_timed_out_total",
                "Connections closed after the handshake or idle timeout.",
                "",
                self.connections_timed_out.load(Ordering::Relaxed),
            ),
            (
                "dart_ngram_reloads_total",
                "Model reloads on SIGHUP, by result.",
                "{result=\"ok\"}",
                self.reloads[0].load(Ordering::Relaxed),
            ),
            (
                "dart_ngram_reloads_total",
                "",
                "{result=\"refused\"}",
                self.reloads[1].load(Ordering::Relaxed),
            ),
        ];
        for (name, help, labels, value) in counters {
            if !help.is_empty() {
                let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            }
            let _ = writeln!(out, "{name}{labels} {value}");
        }
        out.push_str("# HELP dart_ngram_connections_open gRPC connections open now.\n");
        out.push_str("# TYPE dart_ngram_connections_open gauge\n");
        let _ = writeln!(
            out,
            "dart_ngram_connections_open {}",
            self.connections_open.load(Ordering::Relaxed)
        );
        out.push_str("# HELP dart_ngram_model_bytes Size of the served model file.\n");
        out.push_str("# TYPE dart_ngram_model_bytes gauge\n");
        let _ = writeln!(
            out,
            "dart_ngram_model_bytes {}",
            self.model_bytes.load(Ordering::Relaxed)
        );
        if let Some(resident) = self.resident_probe.get().and_then(|probe| probe()) {
            out.push_str(
                "# HELP dart_ngram_model_resident_bytes Bytes of the served model in the page \
                 cache (a --prefetch start climbs to dart_ngram_model_bytes).\n",
            );
            out.push_str("# TYPE dart_ngram_model_resident_bytes gauge\n");
            let _ = writeln!(out, "dart_ngram_model_resident_bytes {resident}");
        }
        out.push_str("# HELP dart_ngram_uptime_seconds Seconds since the daemon started.\n");
        out.push_str("# TYPE dart_ngram_uptime_seconds gauge\n");
        let _ = writeln!(
            out,
            "dart_ngram_uptime_seconds {:.3}",
            self.started.elapsed().as_secs_f64()
        );
        out
    }
}

/// Records one request when dropped.
pub struct RequestGuard {
    metrics: Arc<Metrics>,
    method: usize,
    started: Instant,
    code: Option<usize>,
}

impl RequestGuard {
    pub fn set_code(&mut self, code: usize) {
        self.code = Some(code);
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.metrics.in_flight.fetch_sub(1, Ordering::Relaxed);
        // No code set means the future was dropped before the handler answered: the client
        // cancelled (or the connection died).
        let code = self.code.unwrap_or(tonic::Code::Cancelled as usize);
        self.metrics
            .record(self.method, code, self.started.elapsed());
    }
}

/// Serves `GET /metrics` over plain HTTP/1.1 until `shutdown` resolves. Anything else gets 404.
pub async fn serve_http(
    listener: TcpListener,
    metrics: Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(x) => x,
                    Err(err) => {
                        tracing::warn!(error = %err, "metrics endpoint: accept failed");
                        // Back off so a persistent error (EMFILE) does not spin the loop.
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let metrics = Arc::clone(&metrics);
                tokio::spawn(async move {
                    if let Err(err) = answer(stream, metrics).await {
                        tracing::debug!(%peer, error = %err, "metrics endpoint: request failed");
                    }
                });
            }
        }
    }
}

async fn answer(mut stream: tokio::net::TcpStream, metrics: Arc<Metrics>) -> std::io::Result<()> {
    // Read only the request head, bounded in size and time: a scraper sends a few hundred bytes.
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let head = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            buf.extend_from_slice(&chunk[..n]);
            if buf.windows(4).any(|w| w == b"\r\n\r\n") || buf.len() > 16 * 1024 {
                break;
            }
        }
        Ok::<_, std::io::Error>(())
    })
    .await;
    if head.is_err() {
        return Ok(());
    }
    head.unwrap_or(Ok(()))?;
    let line = buf.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let (status, ctype, body) = if method == "GET" && (path == "/metrics" || path == "/") {
        // Off the async workers: the resident probe walks the model's pages (milliseconds
        // for a model of gigabytes).
        let body = tokio::task::spawn_blocking(move || metrics.render())
            .await
            .map_err(std::io::Error::other)?;
        ("200 OK", "text/plain; version=0.0.4; charset=utf-8", body)
    } else {
        (
            "404 Not Found",
            "text/plain; charset=utf-8",
            "only GET /metrics is served here\n".to_string(),
        )
    };
    let response = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_codes_and_cumulative_buckets() {
        let m = Arc::new(Metrics::new());
        let prune = Metrics::method_index("/dart.ngram.v1.NGramService/Prune");
        assert_eq!(METHODS[prune], "/dart.ngram.v1.NGramService/Prune");
        assert_eq!(Metrics::method_index("/x.Y/Z"), OTHER);
        m.record(prune, 0, Duration::from_micros(30));
        m.record(prune, 0, Duration::from_millis(3));
        m.record(prune, 3, Duration::from_secs(10));
        {
            // A dropped guard without a code counts as CANCELLED.
            let _g = m.start(prune);
        }
        let text = m.render();
        assert!(text.contains(
            "dart_ngram_requests_total{method=\"/dart.ngram.v1.NGramService/Prune\",code=\"OK\"} 2"
        ));
        assert!(text.contains(
            "dart_ngram_errors_total{method=\"/dart.ngram.v1.NGramService/Prune\",code=\"INVALID_ARGUMENT\"} 1"
        ));
        assert!(text.contains("code=\"CANCELLED\"} 1"));
        // The cancelled guard took ~0 s, the others 30 us, 3 ms and 10 s: cumulative buckets.
        let bucket = |le: &str| {
            format!(
                "dart_ngram_request_duration_seconds_bucket{{method=\"/dart.ngram.v1.NGramService/Prune\",le=\"{le}\"}} "
            )
        };
        for (le, n) in [("0.000025", 1), ("0.00005", 2), ("0.005", 3), ("2.5", 3)] {
            assert!(
                text.contains(&format!("{}{n}\n", bucket(le))),
                "le={le}: {text}"
            );
        }
        assert!(text.contains(
            "dart_ngram_request_duration_seconds_bucket{method=\"/dart.ngram.v1.NGramService/Prune\",le=\"+Inf\"} 4"
        ));
        assert!(text.contains("dart_ngram_in_flight_requests 0"));
    }

    #[tokio::test]
    async fn http_endpoint_serves_metrics_and_404s_the_rest() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let metrics = Arc::new(Metrics::new());
        metrics.set_model_bytes(1234);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(serve_http(listener, metrics, async {
            let _ = rx.await;
        }));
        let get = |path: &'static str| async move {
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
                .await
                .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        let ok = get("/metrics").await;
        assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
        assert!(ok.contains("dart_ngram_model_bytes 1234"));
        assert!(get("/nope").await.starts_with("HTTP/1.1 404"));
        tx.send(()).unwrap();
        server.await.unwrap();
    }
}
