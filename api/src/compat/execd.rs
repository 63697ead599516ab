//! The per-sandbox execd surface (`/compat/opensandbox/execd/{id}/…`) the SDK reaches through
//! the endpoint of port 44772: readiness (`/ping`) and files (`/files/upload`,
//! `/files/download`); commands are [`super::command`]. Served by the API on Berth's own exec
//! and files paths (API → NATS → hostd → the sandbox's agent), so file transfers keep their
//! streaming, their size limit and the org's transfer cap.
//!
//! # Authorisation
//! Every request carries the sandbox's execd token (`X-Berth-Execd-Token`, from the endpoint
//! lookup): missing, unknown, or another sandbox's token is 401, before anything of the
//! sandbox is revealed. The token opens this sandbox's exec and files only.

use std::collections::BTreeMap;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use berth_schemas::wire::{AgentFailure, ExecSpec};
use berth_schemas::SandboxState;
use berth_store::SandboxRow;
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::{CompatError, EXECD_TOKEN_HEADER};
use crate::auth::Caller;
use crate::error::ApiError;
use crate::http::files::FileQuery;
use crate::AppState;

/// The largest `metadata` part of an upload, in bytes.
pub const MAX_UPLOAD_METADATA_BYTES: u64 = 64 * 1024;
/// How long a `chmod`/`chown` after an upload may take, in milliseconds.
pub const OWNERSHIP_TIMEOUT_MS: u64 = 30_000;

/// Checks the request's execd token against sandbox `id`'s and answers as its org.
///
/// Errors: 401 `unauthorized` without a token, for an id that names no sandbox, or a token
/// that is not this sandbox's (compared as SHA-256 digests, so in constant time as far as the
/// secret goes); 404 `not_found` once the sandbox is being deleted.
pub async fn authorise(
    app: &AppState,
    headers: &HeaderMap,
    id: &str,
) -> Result<(Caller, SandboxRow), CompatError> {
    let refused = || CompatError::unauthorized("missing or invalid X-Berth-Execd-Token");
    let given = headers
        .get(EXECD_TOKEN_HEADER)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(refused)?;
    let id = id.parse().map_err(|_| refused())?;
    let (row, token) = berth_store::sandboxes::find_with_execd_token(&app.db, id)
        .await?
        .ok_or_else(refused)?;
    let token = token.ok_or_else(refused)?;
    if Sha256::digest(given.as_bytes()) != Sha256::digest(token.as_bytes()) {
        return Err(refused());
    }
    if row.deleting() || row.state == SandboxState::Deleted {
        return Err(ApiError::NotFound(format!("sandbox {id}")).into());
    }
    let caller = Caller {
        org_id: row.org_id,
        key_id: None,
    };
    Ok((caller, row))
}

/// `GET /ping`: 200 while the sandbox runs; 409 `conflict` with its state otherwise (the SDK
/// polls until 2xx; a 404 or 409 keeps it polling at its own pace, a 429/502/503 would slow it).
pub async fn ping(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
) -> Result<StatusCode, CompatError> {
    let (_, row) = authorise(&app, &headers, &id).await?;
    if row.state == SandboxState::Running {
        Ok(StatusCode::OK)
    } else {
        Err(CompatError::new(
            StatusCode::CONFLICT,
            "conflict",
            format!("the sandbox is {}, not running", row.state),
        ))
    }
}

/// `GET /files/download?path=`: the file's bytes, streamed. A directory is 400, a missing
/// path 404; `Range`, `offset` and `limit` are refused (400).
pub async fn download(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    Query(query): Query<BTreeMap<String, String>>,
) -> Result<Response, CompatError> {
    let (caller, _) = authorise(&app, &headers, &id).await?;
    if headers.contains_key(header::RANGE) {
        return Err(CompatError::invalid(
            "Range",
            "ranges are not supported; read the whole file",
        ));
    }
    let mut path = None;
    for (name, value) in query {
        match name.as_str() {
            "path" => path = Some(value),
            other => {
                return Err(CompatError::invalid(
                    other,
                    "is not supported; read the whole file",
                ))
            }
        }
    }
    let path = path.ok_or_else(|| CompatError::invalid("path", "is required"))?;
    let response = crate::http::files::get(
        State(app),
        caller,
        Path(id),
        crate::http::extract::StrictQuery(FileQuery { path: path.clone() }),
    )
    .await?;
    let is_listing = response
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"application/json"));
    if is_listing {
        return Err(CompatError::invalid(
            "path",
            format!("{path} is a directory"),
        ));
    }
    Ok(response)
}

/// The `metadata` part that precedes each `file` part of an upload.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UploadMetadata {
    /// Where the file goes (absolute; parents are created).
    pub path: String,
    /// Its owner after the write (`chown`); `null`: left as written (root).
    pub owner: Option<String>,
    /// Its group after the write; `null`: left as written.
    pub group: Option<String>,
    /// Its permission bits as octal digits held in an integer (`755` is `0o755`); `null`:
    /// left as written (`0644`).
    pub mode: Option<u32>,
}

/// `POST /files/upload`: multipart pairs of a `metadata` part (JSON, [`UploadMetadata`]) and
/// the `file` part it describes, in order; the body may come chunked, with no
/// `Content-Length`. Each file is streamed into place as `PUT …/files` does (at most the
/// API's file limit, 413 past it), then given its mode and owner. 200, empty.
///
/// Errors: 400 for a body that is not such pairs, a mode that is not octal digits, an owner
/// or group the sandbox does not know; the files route's errors.
pub async fn upload(
    State(app): State<AppState>,
    headers: HeaderMap,
    Path(id): Path<String>,
    body: Body,
) -> Result<StatusCode, CompatError> {
    let (caller, row) = authorise(&app, &headers, &id).await?;
    let bad =
        |e: multer::Error| CompatError::invalid("body", format!("not a multipart upload: {e}"));
    let boundary = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .ok_or_else(|| CompatError::invalid("Content-Type", "multipart/form-data is required"))
        .and_then(|ct| multer::parse_boundary(ct).map_err(bad))?;
    let constraints = multer::Constraints::new()
        .allowed_fields(vec!["metadata", "file"])
        .size_limit(multer::SizeLimit::new().for_field("metadata", MAX_UPLOAD_METADATA_BYTES));
    let mut parts =
        multer::Multipart::with_constraints(body.into_data_stream(), boundary, constraints);
    let (mut pending, mut written) = (None::<UploadMetadata>, 0usize);
    while let Some(part) = parts.next_field().await.map_err(bad)? {
        if part.name() == Some("metadata") {
            if pending.is_some() {
                return Err(CompatError::invalid(
                    "metadata",
                    "each metadata part must be followed by its file part",
                ));
            }
            let raw = part.bytes().await.map_err(bad)?;
            let meta: UploadMetadata =
                serde_json::from_slice(&raw).map_err(|e| CompatError::invalid("metadata", e))?;
            ownership_argv(&meta)?;
            pending = Some(meta);
            continue;
        }
        let meta = pending.take().ok_or_else(|| {
            CompatError::invalid("file", "each file part must follow its metadata part")
        })?;
        crate::http::files::put(
            State(app.clone()),
            caller,
            Path(id.clone()),
            crate::http::extract::StrictQuery(FileQuery {
                path: meta.path.clone(),
            }),
            HeaderMap::new(),
            Body::from_stream(part),
        )
        .await?;
        for argv in ownership_argv(&meta)? {
            run_quietly(&app, &caller, &row, argv).await?;
        }
        written += 1;
    }
    if pending.is_some() || written == 0 {
        return Err(CompatError::invalid(
            "body",
            "an upload is one or more pairs of a metadata part and a file part",
        ));
    }
    Ok(StatusCode::OK)
}

/// The `chmod` and `chown` an upload's metadata asks for, after the write.
///
/// Errors: 400 naming `mode` (not octal digits, above 7777) or `owner`/`group` (empty, with
/// `:` or NUL, over 64 bytes).
fn ownership_argv(meta: &UploadMetadata) -> Result<Vec<Vec<String>>, CompatError> {
    let mut argv = Vec::new();
    if let Some(mode) = meta.mode {
        let digits = mode.to_string();
        if mode > 7777 || digits.bytes().any(|d| d > b'7') {
            return Err(CompatError::invalid(
                "mode",
                format!("{mode} is not a mode in octal digits (like 644 or 755)"),
            ));
        }
        argv.push(vec!["chmod".into(), digits, meta.path.clone()]);
    }
    let name_ok =
        |n: &String| !n.is_empty() && n.len() <= 64 && !n.contains(':') && !n.contains('\0');
    for (field, name) in [("owner", &meta.owner), ("group", &meta.group)] {
        if name.as_ref().is_some_and(|n| !name_ok(n)) {
            return Err(CompatError::invalid(
                field,
                "is 1 to 64 bytes without ':' or NUL",
            ));
        }
    }
    let spec = match (&meta.owner, &meta.group) {
        (None, None) => None,
        (Some(owner), None) => Some(owner.clone()),
        (None, Some(group)) => Some(format!(":{group}")),
        (Some(owner), Some(group)) => Some(format!("{owner}:{group}")),
    };
    if let Some(spec) = spec {
        argv.push(vec!["chown".into(), spec, meta.path.clone()]);
    }
    Ok(argv)
}

/// Runs `argv` in the sandbox through its agent; a non-zero exit is 400 with its stderr.
async fn run_quietly(
    app: &AppState,
    caller: &Caller,
    row: &SandboxRow,
    argv: Vec<String>,
) -> Result<(), CompatError> {
    let host = row.host_id.ok_or_else(|| ApiError::Conflict {
        state: row.state,
        message: "the sandbox has no host".into(),
    })?;
    let spec = ExecSpec {
        argv: argv.clone(),
        env: Vec::new(),
        cwd: None,
        stdin: Vec::new(),
        timeout_ms: OWNERSHIP_TIMEOUT_MS,
    };
    let wait = std::time::Duration::from_millis(OWNERSHIP_TIMEOUT_MS)
        + crate::http::exec::EXEC_REPLY_GRACE;
    match crate::http::exec::run(app, host, row.id, spec, wait).await? {
        Ok(out) if out.exit_code == 0 => Ok(()),
        Ok(out) => Err(CompatError::invalid(
            &argv[0],
            format!("exit {}: {}", out.exit_code, out.stderr.trim()),
        )),
        Err(AgentFailure::NotFound | AgentFailure::NotRunning) => {
            let sandbox = crate::model::Sandbox::from(row.clone());
            Err(crate::http::exec::stopped_meanwhile(app, caller, &sandbox)
                .await
                .into())
        }
        Err(other) => Err(ApiError::Agent(format!("{other:?}")).into()),
    }
}
