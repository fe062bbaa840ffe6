//! `/metrics` over HTTP: the routes and the server (hyper/axum, what
//! tonic already brings), rendering the one registry of [`super::Metrics`].

use std::sync::Arc;

use super::Metrics;

/// The Content-Type of [`Metrics::render`]'s output.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The `/metrics` routes: `GET` (and `HEAD`) `/metrics` renders `metrics`;
/// any other path is 404, another method on `/metrics` 405.
pub fn router(metrics: Arc<Metrics>) -> axum::Router {
    use axum::http::{header, StatusCode};
    use axum::routing::get;
    axum::Router::new()
        .route(
            "/metrics",
            get(
                |axum::extract::State(m): axum::extract::State<Arc<Metrics>>| async move {
                    ([(header::CONTENT_TYPE, CONTENT_TYPE)], m.render())
                },
            ),
        )
        .fallback(|| async { (StatusCode::NOT_FOUND, "only /metrics here\n") })
        .with_state(metrics)
}

/// How long a connection may take to send a request's headers.
const HEADER_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Serve [`router`] over HTTP/1 on `listener` until the task is dropped. A
/// malformed request is answered 400 by hyper and closed; a client that sends
/// no complete headers within 5 s is dropped; neither stops the server.
pub async fn serve(listener: tokio::net::TcpListener, metrics: Arc<Metrics>) {
    let app = router(metrics);
    loop {
        let sock = match listener.accept().await {
            Ok((s, _)) => s,
            Err(e) => {
                // Out of fds, typically: wait instead of spinning.
                tracing::debug!(error = %e, "metrics: accept failed");
                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                continue;
            }
        };
        let svc = hyper_util::service::TowerToHyperService::new(app.clone());
        tokio::spawn(async move {
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .serve_connection(hyper_util::rt::TokioIo::new(sock), svc);
            if let Err(e) = conn.await {
                tracing::debug!(error = %e, "metrics: connection ended");
            }
        });
    }
}
