//! The `templates` table: a template imported on the hosts (`berth template import`) is
//! registered here so creates may name it ([`register`]); a template pulled from an OCI image
//! is registered and pulled by [`create_from_image`] (`POST /v1/templates`) or
//! [`ensure_image_template`] (a create by image); [`list`] and [`get`] serve the reads.
//!
//! # Pulls
//! The API process pulls through an [`ImagePuller`] (the `berth` binary gives it hostd's
//! image cache on this machine): resolving the reference to this platform's manifest digest,
//! fetching every layer into the machine's content-addressed cache and unpacking it (so a
//! hostile or oversized image fails the template, not a sandbox). The template becomes
//! `ready` with the image pinned to that digest; hosts pull by that digest on first use (on
//! this machine they find it in the cache). Each step is a template event; states follow
//! [`berth_schemas::template_state`].

use std::sync::Arc;

use berth_schemas::template_state::{on_event, TemplateDecision, TemplateEvent, TemplateState};
use berth_store::templates::{self, PullOutcome, TemplateRow};
use berth_store::StoreError;
use futures::future::BoxFuture;
use sqlx::PgPool;
use tokio::sync::mpsc;
use tracing::{info, warn};

use super::ServiceError;
use crate::model::{Template, TemplateEvent as ApiTemplateEvent};

/// Template event types (`template_events.type`).
pub const EVENT_PULLING: &str = "template.pulling";
/// A step of a pull (resolved, one layer cached).
pub const EVENT_PROGRESS: &str = "template.progress";
/// The pull succeeded.
pub const EVENT_READY: &str = "template.ready";
/// The pull failed.
pub const EVENT_FAILED: &str = "template.failed";

/// The longest image reference accepted, in bytes.
pub const MAX_IMAGE_REF_LEN: usize = 512;

/// The longest template name, in bytes (hostd's `MAX_TEMPLATE_NAME_LEN`).
pub const MAX_NAME_LEN: usize = 64;

/// What a successful pull found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PulledImage {
    /// `registry/repo@sha256:...`.
    pub pinned: String,
    /// `sha256:...`.
    pub digest: String,
    /// Compressed size of its layers in bytes.
    pub bytes: u64,
    /// Its entrypoint followed by its cmd.
    pub entrypoint: Vec<String>,
}

/// Why a pull failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullFailure {
    /// A stable code: `unknown_image`, `auth_failed`, `unsupported_platform`,
    /// `image_too_large`, `hostile_layer`, `unsupported_layer`, `bad_reference`,
    /// `registry_error`, `io_error`.
    pub code: String,
    /// For people.
    pub message: String,
}

/// Pulls images for templates. `progress` takes one line per step.
pub trait ImagePuller: Send + Sync + 'static {
    /// Pulls `image` (a reference as a user wrote it) into the machine's image cache.
    fn pull(
        &self,
        image: String,
        progress: mpsc::UnboundedSender<String>,
    ) -> BoxFuture<'static, Result<PulledImage, PullFailure>>;

    /// Removes the unpacked root of manifest `digest` (`sha256:...`) from the machine's image
    /// cache; layer blobs stay. Returns whether there was one.
    fn remove(&self, digest: String) -> BoxFuture<'static, Result<bool, String>>;
}

/// Registers (or updates) template `name` with `runtime` (`runc`, `runsc`).
///
/// The template's root filesystem must exist on every host that may be chosen for it (hostd
/// finds imported templates in its machine's template cache); placement does not check.
///
/// Errors: [`StoreError`] (a runtime other than `runc` or `runsc` breaks the table's CHECK).
pub async fn register(
    db: &PgPool,
    name: &str,
    description: &str,
    runtime: &str,
) -> Result<(), StoreError> {
    templates::upsert(
        db,
        &TemplateRow {
            name: name.to_owned(),
            description: description.to_owned(),
            runtime: runtime.to_owned(),
            ..Default::default()
        },
    )
    .await
}

/// Every registered template, by name.
pub async fn list(db: &PgPool) -> Result<Vec<Template>, ServiceError> {
    Ok(templates::list(db)
        .await?
        .into_iter()
        .map(|t| to_api(t, None))
        .collect())
}

/// Template `name` with its events.
///
/// Errors: [`ServiceError::NotFound`].
pub async fn get(db: &PgPool, name: &str) -> Result<Template, ServiceError> {
    // No template name holds NUL (nor can Postgres text): not found, without asking.
    if name.contains('\0') {
        return Err(ServiceError::NotFound(format!(
            "template {}",
            name.escape_default()
        )));
    }
    let row = templates::get(db, name)
        .await?
        .ok_or_else(|| ServiceError::NotFound(format!("template {name}")))?;
    let events = templates::events(db, name).await?;
    Ok(to_api(row, Some(events)))
}

/// Refuses a create naming a template that is not `ready`.
///
/// Errors: [`ServiceError::TemplateConflict`] `template_not_ready`, saying why.
pub fn check_ready(template: &TemplateRow) -> Result<(), ServiceError> {
    let state = template.state()?;
    if state == TemplateState::Ready {
        return Ok(());
    }
    let message = match state {
        TemplateState::Pulling => format!(
            "template {} is still pulling its image; retry when it is ready (GET /v1/templates/{})",
            template.name, template.name
        ),
        _ => format!(
            "template {}: its image pull failed ({}: {}); POST /v1/templates again to retry",
            template.name,
            template.error_code.as_deref().unwrap_or("unknown"),
            template.error_message.as_deref().unwrap_or("")
        ),
    };
    Err(ServiceError::TemplateConflict {
        code: "template_not_ready",
        state: state.as_str().to_owned(),
        message,
    })
}

/// Registers template `name` from `image` on `runtime` and starts its pull in the
/// background; returns the template as it is now (`pulling`, or `ready`/`failed` when the
/// same request was made before: idempotent). A `failed` template asked for again is pulled
/// again.
///
/// Errors: [`ServiceError::InvalidRequest`] for a bad name, image reference or runtime;
/// [`ServiceError::TemplateConflict`] `template_exists` when the name is taken by another
/// template (a built-in, or another image or runtime).
pub async fn create_from_image(
    db: &PgPool,
    puller: &Arc<dyn ImagePuller>,
    name: &str,
    image: &str,
    runtime: &str,
    description: Option<&str>,
) -> Result<Template, ServiceError> {
    validate(name, image, runtime)?;
    if description.is_some_and(|d| d.contains('\0')) {
        // Postgres text holds no NUL: refused here, not a 500 from the insert.
        return Err(ServiceError::InvalidRequest {
            field: "description",
            message: "description cannot hold NUL".into(),
        });
    }
    let description = description
        .map(str::to_owned)
        .unwrap_or_else(|| format!("OCI image {image}"));
    let inserted = templates::insert_image(db, name, &description, runtime, image).await?;
    if inserted {
        start_pull(
            db.clone(),
            puller.clone(),
            name.to_owned(),
            image.to_owned(),
        )
        .await?;
        return get(db, name).await;
    }
    let existing = templates::get(db, name)
        .await?
        .ok_or_else(|| ServiceError::Internal(format!("template {name} vanished")))?;
    if existing.image.as_deref() != Some(image) || existing.runtime != runtime {
        return Err(ServiceError::TemplateConflict {
            code: "template_exists",
            state: existing.state()?.as_str().to_owned(),
            message: format!(
                "template {name} exists with {} on {}; choose another name",
                existing
                    .image
                    .as_deref()
                    .map_or("a root filesystem of its own".to_owned(), |i| format!(
                        "image {i}"
                    )),
                existing.runtime
            ),
        });
    }
    let decision = on_event(existing.state()?, TemplateEvent::PullRequested)
        .map_err(|e| ServiceError::Internal(e.to_string()))?;
    if decision == TemplateDecision::StartPull && templates::restart_pull(db, name).await? {
        start_pull(
            db.clone(),
            puller.clone(),
            name.to_owned(),
            image.to_owned(),
        )
        .await?;
    }
    get(db, name).await
}

/// Deletes image template `name` and its events (`DELETE /v1/templates/{name}`), then frees
/// its unpacked root in this machine's image cache when no other template pinned the same
/// digest. Kept: the layer blobs (content-addressed, shared between images), and the copies on
/// hosts of other machines (they have no sweep yet). A pull still running finishes into the
/// cache and writes nothing (its row is gone).
///
/// Errors: [`ServiceError::NotFound`]; [`ServiceError::TemplateConflict`] `template_in_use`
/// (sandboxes not yet deleted name it: delete them first) or `template_builtin` (a built-in or
/// imported template, not from an image: the operator's).
pub async fn delete(
    db: &PgPool,
    puller: Option<&Arc<dyn ImagePuller>>,
    name: &str,
) -> Result<(), ServiceError> {
    use berth_store::templates::Deleted;
    if name.contains('\0') {
        return Err(ServiceError::NotFound(format!(
            "template {}",
            name.escape_default()
        )));
    }
    match templates::delete(db, name).await? {
        Deleted::NotFound => Err(ServiceError::NotFound(format!("template {name}"))),
        Deleted::NotAnImage(row) => Err(ServiceError::TemplateConflict {
            code: "template_builtin",
            state: row.state()?.as_str().to_owned(),
            message: format!(
                "template {name} is not from an image (built-in or imported on the hosts): the \
                 operator removes it"
            ),
        }),
        Deleted::InUse {
            row,
            sandboxes,
            snapshots,
        } => Err(ServiceError::TemplateConflict {
            code: "template_in_use",
            state: row.state()?.as_str().to_owned(),
            message: format!(
                "{sandboxes} sandbox(es) not yet deleted and {snapshots} snapshot(s) not failed \
                 use template {name}; delete them first"
            ),
        }),
        Deleted::Deleted {
            row,
            unshared_digest,
        } => {
            info!(template = %name, image = ?row.image, "template deleted");
            if let (Some(digest), Some(puller)) = (unshared_digest, puller) {
                match puller.remove(digest.clone()).await {
                    Ok(freed) => info!(template = %name, %digest, freed, "image root freed"),
                    Err(e) => warn!(template = %name, %digest, error = %e, "image root not freed"),
                }
            }
            Ok(())
        }
    }
}

/// The template for `image` on `runtime`, registered and pulled on first use: what a create
/// by image (OpenSandbox's `image.uri`) calls. The name is derived from the image and runtime
/// ([`image_template_name`]), so every create of one image shares one template. Returns its
/// name and state: the create may proceed when `ready`, should wait (poll [`get`]) while
/// `pulling`, and should fail with the template's error when `failed`.
///
/// Errors: as [`create_from_image`].
pub async fn ensure_image_template(
    db: &PgPool,
    puller: &Arc<dyn ImagePuller>,
    image: &str,
    runtime: &str,
) -> Result<(String, TemplateState), ServiceError> {
    let name = image_template_name(image, runtime);
    let template = create_from_image(db, puller, &name, image, runtime, None).await?;
    let state = template
        .state
        .parse()
        .map_err(|e| ServiceError::Internal(format!("template state: {e:?}")))?;
    Ok((name, state))
}

/// The template name for `image` on `runtime`: `img-` and a sanitized tail of the reference,
/// then 12 hex digits of the SHA-256 of `runtime` and `image` (so two references never
/// share a name), at most [`MAX_NAME_LEN`] bytes.
pub fn image_template_name(image: &str, runtime: &str) -> String {
    use sha2::{Digest, Sha256};
    let hash = hex::encode(Sha256::digest(format!("{runtime}\n{image}").as_bytes()));
    let readable: String = image
        .rsplit('/')
        .next()
        .unwrap_or(image)
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .take(MAX_NAME_LEN - 4 - 13)
        .collect();
    format!("img-{}-{}", readable.trim_matches('-'), &hash[..12])
}

fn validate(name: &str, image: &str, runtime: &str) -> Result<(), ServiceError> {
    let bad = |field, message: String| ServiceError::InvalidRequest { field, message };
    let name_ok = !name.is_empty()
        && name.len() <= MAX_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-');
    if !name_ok {
        return Err(bad(
            "name",
            format!(
                "template names are 1 to {MAX_NAME_LEN} of a-z, 0-9 and '-', not starting with '-'"
            ),
        ));
    }
    if image.is_empty()
        || image.len() > MAX_IMAGE_REF_LEN
        || image
            .bytes()
            .any(|b| b.is_ascii_whitespace() || b.is_ascii_control())
    {
        return Err(bad(
            "image",
            format!("image is a reference like registry/repo:tag, at most {MAX_IMAGE_REF_LEN} bytes, no spaces"),
        ));
    }
    if runtime.parse::<berth_schemas::wire::Runtime>().is_err() {
        return Err(bad("runtime", "runtime is runc or runsc".into()));
    }
    Ok(())
}

/// Records the pull's start and runs it in a task that records its progress and outcome.
async fn start_pull(
    db: PgPool,
    puller: Arc<dyn ImagePuller>,
    name: String,
    image: String,
) -> Result<(), ServiceError> {
    templates::add_event(&db, &name, EVENT_PULLING, &format!("pulling {image}")).await?;
    tokio::spawn(async move {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let pull = puller.pull(image.clone(), tx);
        let progress_db = db.clone();
        let progress_name = name.clone();
        let progress = tokio::spawn(async move {
            while let Some(line) = rx.recv().await {
                if let Err(e) =
                    templates::add_event(&progress_db, &progress_name, EVENT_PROGRESS, &line).await
                {
                    warn!(template = %progress_name, error = %e, "template progress not recorded");
                }
            }
        });
        let outcome = pull.await;
        let _ = progress.await;
        let (event, message, outcome) = match outcome {
            Ok(p) => (
                EVENT_READY,
                format!("{image} is {} ({} bytes of layers)", p.digest, p.bytes),
                PullOutcome::Pulled {
                    pinned: p.pinned,
                    digest: p.digest,
                    bytes: i64::try_from(p.bytes).unwrap_or(i64::MAX),
                    entrypoint: p.entrypoint,
                },
            ),
            Err(f) => (
                EVENT_FAILED,
                format!("{}: {}", f.code, f.message),
                PullOutcome::Failed {
                    code: f.code,
                    message: f.message,
                },
            ),
        };
        // The state and its event commit together: a reader that sees `ready` sees why.
        let recorded = async {
            let mut tx = db.begin().await?;
            let written = templates::finish_pull(&mut *tx, &name, &outcome).await?;
            if written {
                templates::add_event(&mut *tx, &name, event, &message).await?;
            }
            tx.commit().await?;
            Ok::<bool, ServiceError>(written)
        };
        match recorded.await {
            Ok(true) => info!(template = %name, %image, outcome = event, "template pull finished"),
            Ok(false) => info!(template = %name, "template pull result was stale"),
            Err(e) => warn!(template = %name, error = %e, "template pull result not recorded"),
        }
    });
    Ok(())
}

fn to_api(t: TemplateRow, events: Option<Vec<templates::TemplateEventRow>>) -> Template {
    let state = t.state().map(|s| s.as_str()).unwrap_or("ready").to_owned();
    Template {
        name: t.name,
        description: t.description,
        runtime: t.runtime,
        state,
        image: t.image,
        image_digest: t.image_digest,
        image_bytes: t.image_bytes,
        entrypoint: t.entrypoint.map(|e| e.0),
        error_code: t.error_code,
        error_message: t.error_message,
        events: events.map(|es| {
            es.into_iter()
                .map(|e| ApiTemplateEvent {
                    at: e.at,
                    kind: e.kind,
                    message: e.message,
                })
                .collect()
        }),
    }
}
