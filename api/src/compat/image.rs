//! OpenSandbox's `image.uri` → a Berth template: a name that is a template of this Berth
//! (`base`, `python`, an image template made by `POST /v1/templates`) is that template; any
//! other reference is an OCI image, made a template on first use through
//! [`crate::templates::ensure_image_template`] (the same pull as `POST /v1/templates`, on
//! [`DEFAULT_IMAGE_RUNTIME`]), and the create waits for its pull for at most
//! [`IMAGE_PULL_WAIT`], under the SDK's own 30 s request timeout.
//!
//! # Errors (each `{code, message}`, which the SDK raises as its `SandboxApiException`)
//! - 400 `unsupported_image`: this API process has no image cache to pull into.
//! - 400 `invalid_request`: the reference is not one (`image.uri` named).
//! - 400 with the pull's own code (`unknown_image`, `auth_failed`, `unsupported_platform`,
//!   `image_too_large`, `hostile_layer`, `unsupported_layer`, `bad_reference`,
//!   `pull_timed_out`) or 503 (`registry_error`, `io_error`: transient, the next create
//!   pulls again).
//! - 409 `template_not_ready`: still pulling after [`IMAGE_PULL_WAIT`]; the pull goes on and a
//!   later create finds the template ready.

use std::time::Duration;

use axum::http::StatusCode;
use berth_schemas::template_state::TemplateState;

use super::CompatError;
use crate::error::ApiError;
use crate::http::templates::DEFAULT_IMAGE_RUNTIME;
use crate::service::ServiceError;
use crate::AppState;

/// The longest a create by image waits for the image's pull, below the SDK's 30 s
/// `request_timeout` so that the SDK gets Berth's answer rather than its own timeout.
pub const IMAGE_PULL_WAIT: Duration = Duration::from_secs(22);

/// How often a waiting create looks at the template's state.
pub const IMAGE_PULL_POLL: Duration = Duration::from_millis(200);

/// The pull failure codes passed on as they are (`templates.error_code`); another code is
/// shown as `image_pull_failed`.
const PULL_CODES: [&str; 10] = [
    "unknown_image",
    "auth_failed",
    "unsupported_platform",
    "image_too_large",
    "hostile_layer",
    "unsupported_layer",
    "bad_reference",
    "registry_error",
    "io_error",
    "pull_timed_out",
];

/// The template a create by `uri` runs from: `uri` itself when it names a template, else the
/// template of the image `uri`, pulled first (waiting at most [`IMAGE_PULL_WAIT`]).
///
/// Errors: see the module's.
pub async fn template_for(app: &AppState, uri: &str) -> Result<String, CompatError> {
    if berth_store::templates::get(&app.db, uri).await?.is_some() {
        return Ok(uri.to_owned());
    }
    let puller = app.images.clone().ok_or_else(|| {
        CompatError::new(
            StatusCode::BAD_REQUEST,
            "unsupported_image",
            format!(
                "image.uri {uri:?} is not a template of this Berth, and this API process \
                 cannot pull images; name a template (GET /v1/templates)"
            ),
        )
    })?;
    let (name, mut state) =
        crate::templates::ensure_image_template(&app.db, &puller, uri, DEFAULT_IMAGE_RUNTIME)
            .await
            .map_err(|e| match e {
                ServiceError::InvalidRequest { message, .. } => {
                    CompatError::invalid("image.uri", message)
                }
                other => ApiError::from(other).into(),
            })?;
    let deadline = tokio::time::Instant::now() + IMAGE_PULL_WAIT;
    loop {
        match state {
            TemplateState::Ready => return Ok(name),
            TemplateState::Failed => {
                let row = berth_store::templates::get(&app.db, &name).await?;
                let (code, message) = row
                    .map(|t| (t.error_code, t.error_message))
                    .unwrap_or_default();
                return Err(pull_failed(uri, code.as_deref(), message.as_deref()));
            }
            TemplateState::Pulling if tokio::time::Instant::now() >= deadline => {
                return Err(CompatError::new(
                    StatusCode::CONFLICT,
                    "template_not_ready",
                    format!(
                        "image {uri} is still being pulled (template {name}); create again \
                         in a while: the pull goes on"
                    ),
                ))
            }
            TemplateState::Pulling => {}
        }
        tokio::time::sleep(IMAGE_PULL_POLL).await;
        state = match berth_store::templates::get(&app.db, &name).await? {
            Some(row) => row.state()?,
            // Deleted under us: as if it had failed.
            None => TemplateState::Failed,
        };
    }
}

/// The answer for a failed pull: 503 for a transient failure (the next create pulls again),
/// 400 for an image that cannot be used.
fn pull_failed(uri: &str, code: Option<&str>, message: Option<&str>) -> CompatError {
    let code = code
        .and_then(|c| PULL_CODES.iter().copied().find(|known| *known == c))
        .unwrap_or("image_pull_failed");
    let status = if matches!(code, "registry_error" | "io_error") {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::BAD_REQUEST
    };
    CompatError::new(
        status,
        code,
        format!(
            "image {uri} could not be pulled: {}",
            message.unwrap_or("no reason recorded")
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failed_pull_keeps_its_code_and_only_transient_ones_are_503() {
        let e = pull_failed("r/x:1", Some("unknown_image"), Some("not found"));
        assert_eq!(
            (e.status, e.code),
            (StatusCode::BAD_REQUEST, "unknown_image")
        );
        assert!(e.message.contains("r/x:1") && e.message.contains("not found"));
        let e = pull_failed("r/x:1", Some("registry_error"), None);
        assert_eq!(
            (e.status, e.code),
            (StatusCode::SERVICE_UNAVAILABLE, "registry_error")
        );
        let e = pull_failed("r/x:1", Some("something new"), None);
        assert_eq!(
            (e.status, e.code),
            (StatusCode::BAD_REQUEST, "image_pull_failed")
        );
    }
}
