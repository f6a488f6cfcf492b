//! A tower layer around the whole gRPC server: per-request metrics and logs, and the status
//! of an oversized request.
//!
//! A request counts as in flight (the `dart_ngram_in_flight_requests` gauge, which a drain on
//! SIGTERM waits on) from its headers until its response body has been handed over in full
//! (trailers included) or dropped, not merely until its handler returned: the guard travels
//! inside the response body ([`ObservedBody`]).
//!
//! It sits at the HTTP level so it sees every request, including those tonic refuses before
//! any handler runs (an oversized message, an unknown method). A unary error is a
//! "trailers-only" response whose `grpc-status` is in the response headers; an OK response
//! carries no `grpc-status` header (it comes in the trailers), so headers alone tell the code.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

use http::{HeaderValue, Request, Response};
use http_body::{Body, Frame, SizeHint};
use tower::{Layer, Service};

use crate::busy_poll::Activity;
use crate::metrics::{Metrics, RequestGuard, METHODS};

#[derive(Clone)]
pub struct ObserveLayer {
    metrics: Arc<Metrics>,
    max_request_bytes: usize,
    activity: Option<Arc<Activity>>,
    draining: Arc<AtomicBool>,
}

impl ObserveLayer {
    /// `activity`: told of every request when the daemon busy-polls. `draining`: once true,
    /// requests that arrive (health checks apart) are answered UNAVAILABLE without running.
    pub fn new(
        metrics: Arc<Metrics>,
        max_request_bytes: usize,
        activity: Option<Arc<Activity>>,
        draining: Arc<AtomicBool>,
    ) -> Self {
        ObserveLayer {
            metrics,
            max_request_bytes,
            activity,
            draining,
        }
    }
}

impl<S> Layer<S> for ObserveLayer {
    type Service = Observe<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Observe {
            inner,
            metrics: Arc::clone(&self.metrics),
            max_request_bytes: self.max_request_bytes,
            activity: self.activity.clone(),
            draining: Arc::clone(&self.draining),
        }
    }
}

#[derive(Clone)]
pub struct Observe<S> {
    inner: S,
    metrics: Arc<Metrics>,
    max_request_bytes: usize,
    activity: Option<Arc<Activity>>,
    draining: Arc<AtomicBool>,
}

/// Health checks keep answering during a drain (they report NOT_SERVING).
fn is_health(method: usize) -> bool {
    METHODS[method].starts_with("/grpc.health.")
}

impl<S, ReqBody, ResBody> Service<Request<ReqBody>> for Observe<S>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    ResBody: Send + 'static,
{
    type Response = Response<ObservedBody<ResBody>>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<ReqBody>) -> Self::Future {
        if let Some(activity) = &self.activity {
            activity.touch();
        }
        let method = Metrics::method_index(req.uri().path());
        let mut guard = self.metrics.start(method);
        if self.draining.load(Ordering::SeqCst) && !is_health(method) {
            // A request that arrives after the shutdown began is refused with the status
            // clients retry (on another daemon, or this one once restarted).
            let code = tonic::Code::Unavailable;
            guard.set_code(code as usize);
            let mut response = Response::new(ObservedBody {
                inner: None,
                guard: Some(guard),
            });
            set_status(
                &mut response,
                code,
                "the daemon is shutting down; retry on another daemon or after its restart",
            );
            response
                .headers_mut()
                .insert("content-type", HeaderValue::from_static("application/grpc"));
            return Box::pin(async move { Ok(response) });
        }
        let limit = self.max_request_bytes;
        let fut = self.inner.call(req);
        Box::pin(async move {
            let mut response = fut.await?;
            let mut code = grpc_code(&response);
            if code == tonic::Code::OutOfRange as usize && is_size_error(&response) {
                // tonic reports an oversized message as OUT_OF_RANGE; gRPC's convention (and
                // what clients retry-classify on) is RESOURCE_EXHAUSTED.
                rewrite_size_error(&mut response, limit);
                code = tonic::Code::ResourceExhausted as usize;
            } else if code == tonic::Code::Internal as usize && is_decode_error(&response) {
                // tonic reports a request that is not valid protobuf as INTERNAL; it is the
                // caller's fault, and INTERNAL would read as a daemon bug.
                let message = format!(
                    "malformed request: {} (expected a serialized {} request)",
                    grpc_message(&response),
                    name_of(method)
                );
                set_status(&mut response, tonic::Code::InvalidArgument, &message);
                code = tonic::Code::InvalidArgument as usize;
            }
            guard.set_code(code);
            let micros = guard.elapsed().as_micros() as u64;
            let name = METHODS[method];
            if code == 0 {
                tracing::debug!(method = name, code = "OK", micros, "request");
            } else {
                let message = grpc_message(&response);
                let code_name = crate::metrics::CODES
                    .get(code)
                    .copied()
                    .unwrap_or("UNKNOWN");
                if code == tonic::Code::Internal as usize || code == tonic::Code::DataLoss as usize
                {
                    tracing::error!(
                        method = name,
                        code = code_name,
                        micros,
                        message,
                        "request failed"
                    );
                } else {
                    tracing::info!(
                        method = name,
                        code = code_name,
                        micros,
                        message,
                        "request refused"
                    );
                }
            }
            Ok(response.map(|body| ObservedBody {
                inner: Some(body),
                guard: Some(guard),
            }))
        })
    }
}

/// A response body that holds its request's [`RequestGuard`] until the last frame (the
/// trailers, for gRPC) has been taken, the body reports its end, it fails, or it is dropped.
/// No inner body: a trailers-only response made by the layer itself.
pub struct ObservedBody<B> {
    inner: Option<B>,
    guard: Option<RequestGuard>,
}

impl<B: Body + Unpin> Body for ObservedBody<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            this.guard = None;
            return Poll::Ready(None);
        };
        let polled = Pin::new(&mut *inner).poll_frame(cx);
        let done = match &polled {
            Poll::Ready(Some(Ok(frame))) => frame.is_trailers() || inner.is_end_stream(),
            Poll::Ready(_) => true,
            Poll::Pending => false,
        };
        if done {
            this.guard = None;
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint)
    }
}

fn grpc_code<B>(response: &Response<B>) -> usize {
    response
        .headers()
        .get("grpc-status")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(0)
}

fn grpc_message<B>(response: &Response<B>) -> String {
    response
        .headers()
        .get("grpc-message")
        .map(|v| percent_decode(v.as_bytes()))
        .unwrap_or_default()
}

fn is_size_error<B>(response: &Response<B>) -> bool {
    grpc_message(response).contains("message length too large")
}

fn is_decode_error<B>(response: &Response<B>) -> bool {
    grpc_message(response).starts_with("failed to decode Protobuf message")
}

fn name_of(method: usize) -> &'static str {
    METHODS[method].rsplit('/').next().unwrap_or("gRPC")
}

fn rewrite_size_error<B>(response: &mut Response<B>, limit: usize) {
    let original = grpc_message(response);
    let message = format!(
        "request too large: {original} (the daemon's --max-request-bytes is {limit}; split the batch)"
    );
    set_status(response, tonic::Code::ResourceExhausted, &message);
}

fn set_status<B>(response: &mut Response<B>, code: tonic::Code, message: &str) {
    let headers = response.headers_mut();
    headers.insert("grpc-status", HeaderValue::from(code as i32));
    if let Ok(v) = HeaderValue::from_str(&percent_encode(message)) {
        headers.insert("grpc-message", v);
    }
}

/// gRPC's percent-encoding of `grpc-message`: bytes outside printable ASCII, and `%`.
pub fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for &b in text.as_bytes() {
        if (0x20..=0x7e).contains(&b) && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

pub fn percent_decode(bytes: &[u8]) -> String {
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).ok();
            if let Some(b) = hex.and_then(|h| u8::from_str_radix(h, 16).ok()) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn percent_coding_round_trips(text in ".{0,64}") {
            let enc = percent_encode(&text);
            prop_assert!(enc.bytes().all(|b| (0x20..=0x7e).contains(&b)));
            prop_assert_eq!(percent_decode(enc.as_bytes()), text);
        }
    }
}
