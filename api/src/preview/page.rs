//! The proxy's own answers: short HTML pages a browser user understands (the API's JSON error
//! body would mean nothing to someone opening a preview URL), and the marker that keeps the
//! API's JSON error rewriting away from preview responses.

use axum::body::Body;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use berth_schemas::{SandboxId, SandboxState};

/// Marks a response as the preview's (forwarded from a sandbox, or one of its pages): the
/// API's `json_errors` layer leaves it as it is.
#[derive(Debug, Clone, Copy)]
pub struct PreviewResponse;

/// Marks `response` as a preview response.
pub fn mark(mut response: Response) -> Response {
    response.extensions_mut().insert(PreviewResponse);
    response
}

/// One of the proxy's own answers.
#[derive(Debug, Clone)]
pub struct Page {
    /// Its status.
    pub status: StatusCode,
    /// One sentence for the reader.
    pub message: String,
    /// Seconds for `Retry-After`, when the client should come back.
    pub retry_after: Option<u64>,
    /// The sandbox's state, when the answer is about it (`X-Berth-Sandbox-State`).
    pub state: Option<SandboxState>,
}

impl Page {
    /// A page with `status` and `message`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            retry_after: None,
            state: None,
        }
    }

    /// 404 for a sandbox that is not there (or not the caller's).
    pub fn not_found(sandbox: SandboxId) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            format!("There is no sandbox {sandbox}."),
        )
    }

    /// 401: no usable credentials.
    pub fn unauthorized(why: &str) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, why.to_owned())
    }

    /// 409: the sandbox is in `state` and will not be woken.
    pub fn conflict(state: SandboxState, why: &str) -> Self {
        Self {
            state: Some(state),
            ..Self::new(
                StatusCode::CONFLICT,
                format!("The sandbox is {state}: {why}."),
            )
        }
    }

    /// 503 with `Retry-After`: still waking.
    pub fn waking(retry_after: u64) -> Self {
        Self {
            retry_after: Some(retry_after),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "The sandbox is waking up; try again in a moment.",
            )
        }
    }

    /// The response: a small HTML page (no caching).
    pub fn into_response(self) -> Response {
        let title = format!(
            "{} {}",
            self.status.as_u16(),
            self.status.canonical_reason().unwrap_or("")
        );
        let html = format!(
            "<!doctype html><html><head><meta charset=\"utf-8\"><title>{title}</title></head>\
             <body><h1>{title}</h1><p>{}</p></body></html>\n",
            escape(&self.message)
        );
        let mut r = Response::new(Body::from(html));
        *r.status_mut() = self.status;
        let h = r.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/html; charset=utf-8"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        if let Some(s) = self.retry_after {
            h.insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        if let Some(state) = self.state {
            if let Ok(v) = HeaderValue::from_str(state.as_str()) {
                h.insert("x-berth-sandbox-state", v);
            }
        }
        mark(r)
    }
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

impl From<berth_store::StoreError> for Page {
    fn from(e: berth_store::StoreError) -> Self {
        tracing::warn!(error = %e, "preview: store error");
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "The preview service cannot reach its database; try again shortly.",
        )
    }
}
