//! `GET` and `PUT /v1/sandboxes/{id}/files?path=`: files inside a running sandbox.
//!
//! Path: API → NATS request/reply on `{p}.agent.<host>` → hostd → the sandbox's agent; the API
//! never reaches a sandbox address. Each message carries at most [`FILE_CHUNK_BYTES`] of file
//! data, so it stays under NATS's default 1 MiB max payload; a file moves in as many chunks as
//! it needs, up to [`MAX_FILE_BYTES`].
//!
//! # Guarantees
//! - An upload is written to a temporary sibling (`.<name>.berth-upload-<uuid>`) and renamed
//!   over the target at the end: a reader never sees half of it.
//! - A download is read in order from offset 0 until the agent reports the end; a file that
//!   grows past [`MAX_FILE_BYTES`] while being read is refused.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_schemas::wire::{self, AgentFailure, AgentOp, AgentReply, AgentRequest, FileKind};
use berth_schemas::HostId;
use serde::{Deserialize, Serialize};
use tracing::instrument;
use utoipa::{IntoParams, ToSchema};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::model::Sandbox;
use crate::AppState;

/// File bytes per NATS message (each way), below NATS's default 1 MiB max payload with room
/// for the envelope.
pub const FILE_CHUNK_BYTES: u32 = 512 * 1024;

/// The largest file a download or upload moves, in bytes (64 MiB).
pub const MAX_FILE_BYTES: u64 = 64 * 1024 * 1024;

/// How long the API waits for the host to answer one file request.
pub const FILE_REQUEST_TIMEOUT: Duration = Duration::from_secs(35);

/// `?path=`: an absolute path inside the sandbox.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct FileQuery {
    /// Absolute path inside the sandbox.
    pub path: String,
}

/// One entry of a directory listing.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FileEntry {
    /// The entry's file name (no directory part).
    pub name: String,
    /// `file`, `dir`, `symlink` or `other`.
    #[serde(rename = "type")]
    pub kind: String,
    /// Bytes.
    pub size: u64,
    /// Permission bits, as a number (`420` = `0o644`).
    pub mode: u32,
    /// Last modification, seconds since the Unix epoch.
    pub modified: i64,
}

/// `GET …/files` of a directory.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DirectoryListing {
    /// The directory listed, as requested.
    pub path: String,
    /// Its entries, as the agent returned them.
    pub entries: Vec<FileEntry>,
}

/// `PUT …/files` response.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FileWritten {
    /// The file written, as requested.
    pub path: String,
    /// Bytes written.
    pub size: u64,
}

fn kind_name(kind: FileKind) -> &'static str {
    match kind {
        FileKind::File => "file",
        FileKind::Dir => "dir",
        FileKind::Symlink => "symlink",
        FileKind::Other => "other",
    }
}

/// `GET /v1/sandboxes/{id}/files?path=`
#[utoipa::path(get, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path), FileQuery),
    responses(
        (status = 200, description = "A file's bytes (`application/octet-stream`), or a directory's listing (JSON)", body = DirectoryListing),
        (status = 400, description = "`invalid_request`: a relative path, or a file over the size limit"),
        (status = 404, description = "`not_found`: no such sandbox or path"),
        (status = 409, description = "`conflict`: the sandbox is not running"),
        (status = 502, description = "`agent_error`"),
        (status = 503, description = "`host_unavailable`"),
    ), security(("bearer" = [])))]
#[instrument(skip_all, fields(org_id = %caller.org_id, sandbox_id = %id))]
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<FileQuery>,
) -> Result<Response, ApiError> {
    let path = absolute(query.path)?;
    let (sandbox, host) = running(&app, &caller, &id).await?;
    let stat = match call(&app, &sandbox, host, AgentOp::Stat { path: path.clone() }).await? {
        AgentReply::Stat(stat) => stat,
        other => return Err(unexpected(other)),
    };
    if stat.kind == FileKind::Dir {
        let entries = match call(&app, &sandbox, host, AgentOp::List { path: path.clone() }).await?
        {
            AgentReply::Listing(entries) => entries,
            other => return Err(unexpected(other)),
        };
        let listing = DirectoryListing {
            path,
            entries: entries
                .into_iter()
                .map(|e| FileEntry {
                    name: e.name,
                    kind: kind_name(e.stat.kind).to_owned(),
                    size: e.stat.size,
                    mode: e.stat.mode,
                    modified: e.stat.modified_unix,
                })
                .collect(),
        };
        return Ok((StatusCode::OK, Json(listing)).into_response());
    }
    if stat.size > MAX_FILE_BYTES {
        return Err(too_large());
    }
    let mut data = Vec::with_capacity(stat.size as usize);
    loop {
        let op = AgentOp::Read {
            path: path.clone(),
            offset: data.len() as u64,
            len: FILE_CHUNK_BYTES,
        };
        match call(&app, &sandbox, host, op).await? {
            AgentReply::Data { data: chunk, eof } => {
                let empty = chunk.is_empty();
                data.extend_from_slice(&chunk);
                if data.len() as u64 > MAX_FILE_BYTES {
                    return Err(too_large());
                }
                if eof || empty {
                    break;
                }
            }
            other => return Err(unexpected(other)),
        }
    }
    metrics::counter!("berth_file_bytes_total", "direction" => "download")
        .increment(data.len() as u64);
    Ok((
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/octet-stream")],
        data,
    )
        .into_response())
}

/// `PUT /v1/sandboxes/{id}/files?path=` with the file's bytes as the body.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path), FileQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses(
        (status = 200, description = "Written (parent directories are created)", body = FileWritten),
        (status = 400, description = "`invalid_request`: a relative path"),
        (status = 404, description = "`not_found`"),
        (status = 409, description = "`conflict`: the sandbox is not running"),
        (status = 413, description = "The body is over the size limit"),
        (status = 502, description = "`agent_error`"),
        (status = 503, description = "`host_unavailable`"),
    ), security(("bearer" = [])))]
#[instrument(skip_all, fields(org_id = %caller.org_id, sandbox_id = %id))]
pub async fn put(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    Query(query): Query<FileQuery>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let path = absolute(query.path)?;
    let (name, dir) = match path.rsplit_once('/') {
        Some((dir, name)) if !name.is_empty() => (name.to_owned(), dir.to_owned()),
        _ => return Err(ApiError::invalid("path", "path must name a file")),
    };
    let temporary = format!(
        "{dir}/.{name}.berth-upload-{}",
        uuid::Uuid::new_v4().simple()
    );
    if temporary.len() - dir.len() - 1 > MAX_NAME_BYTES {
        return Err(ApiError::invalid(
            "path",
            format!(
                "the file name is longer than {} bytes",
                MAX_NAME_BYTES - (temporary.len() - dir.len() - 1 - name.len())
            ),
        ));
    }
    let (sandbox, host) = running(&app, &caller, &id).await?;
    // A directory cannot be replaced by a file: refuse before writing the temporary sibling,
    // which the failed rename would otherwise leave behind. A missing path is the usual case.
    match call(&app, &sandbox, host, AgentOp::Stat { path: path.clone() }).await {
        Ok(AgentReply::Stat(stat)) if stat.kind == FileKind::Dir => {
            return Err(ApiError::invalid("path", "path names a directory"));
        }
        Ok(_) | Err(ApiError::NotFound(_)) => {}
        Err(error) => return Err(error),
    }
    let mut offset = 0usize;
    loop {
        let end = (offset + FILE_CHUNK_BYTES as usize).min(body.len());
        let op = AgentOp::Write {
            path: temporary.clone(),
            offset: offset as u64,
            data: body[offset..end].to_vec(),
            truncate: offset == 0,
        };
        match call(&app, &sandbox, host, op).await? {
            AgentReply::Written { .. } => {}
            other => return Err(unexpected(other)),
        }
        offset = end;
        if offset >= body.len() {
            break;
        }
    }
    let rename = AgentOp::Rename {
        from: temporary,
        to: path.clone(),
    };
    match call(&app, &sandbox, host, rename).await? {
        AgentReply::Done => {}
        other => return Err(unexpected(other)),
    }
    metrics::counter!("berth_file_bytes_total", "direction" => "upload")
        .increment(body.len() as u64);
    let written = FileWritten {
        path,
        size: body.len() as u64,
    };
    Ok((StatusCode::OK, Json(written)).into_response())
}

/// The longest file name Linux takes (`NAME_MAX`); an upload's temporary sibling
/// (`.<name>.berth-upload-<32 hex>`) must fit in it too.
const MAX_NAME_BYTES: usize = 255;

/// The path, when absolute and free of NUL bytes.
fn absolute(path: String) -> Result<String, ApiError> {
    if path.starts_with('/') && !path.contains('\0') {
        Ok(path)
    } else {
        Err(ApiError::invalid(
            "path",
            "path must be an absolute path inside the sandbox",
        ))
    }
}

fn too_large() -> ApiError {
    ApiError::invalid(
        "path",
        format!("the file is larger than the {MAX_FILE_BYTES}-byte limit"),
    )
}

fn unexpected(reply: AgentReply) -> ApiError {
    ApiError::Internal(format!("unexpected agent reply {reply:?}"))
}

fn not_running(sandbox: &Sandbox) -> ApiError {
    ApiError::Conflict {
        state: sandbox.state,
        message: format!("files need a running sandbox; it is {}", sandbox.state),
    }
}

/// The caller's sandbox `id` and its host, when it runs; marks it active (reading or writing
/// its files counts as activity for auto-stop, as an exec does).
async fn running(app: &AppState, caller: &Caller, id: &str) -> Result<(Sandbox, HostId), ApiError> {
    crate::http::sandboxes::running_and_active(app, caller, id, not_running).await
}

/// One agent request through the sandbox's host; failures become API errors.
async fn call(
    app: &AppState,
    sandbox: &Sandbox,
    host: HostId,
    op: AgentOp,
) -> Result<AgentReply, ApiError> {
    let request = AgentRequest {
        sandbox_id: sandbox.id,
        op,
    };
    let reply = app
        .nats
        .send_request(
            app.subjects.agent(host),
            async_nats::Request::new()
                .payload(wire::encode(&request).into())
                .timeout(Some(FILE_REQUEST_TIMEOUT)),
        )
        .await
        .map_err(|e| host_unavailable(host, FILE_REQUEST_TIMEOUT, e))?;
    let reply: AgentReply = wire::decode(&reply.payload)
        .map_err(|e| ApiError::Internal(format!("agent reply from {host}: {e}")))?;
    match reply {
        AgentReply::Failed(failure) => Err(match failure {
            AgentFailure::NotFound | AgentFailure::NotRunning => not_running(sandbox),
            AgentFailure::NoSuchPath => ApiError::NotFound("path".to_owned()),
            AgentFailure::TooLarge { limit } => {
                ApiError::invalid("path", format!("over the agent's limit of {limit}"))
            }
            AgentFailure::Agent(message) => ApiError::Agent(message),
        }),
        other => Ok(other),
    }
}

/// The API error of a failed NATS request to `host`.
pub(crate) fn host_unavailable(
    host: HostId,
    wait: Duration,
    e: async_nats::RequestError,
) -> ApiError {
    match e.kind() {
        async_nats::RequestErrorKind::NoResponders => {
            ApiError::HostUnavailable(format!("host {host} has no agent responder"))
        }
        async_nats::RequestErrorKind::TimedOut => {
            ApiError::HostUnavailable(format!("host {host} did not answer in {wait:?}"))
        }
        _ => ApiError::HostUnavailable(e.to_string()),
    }
}
