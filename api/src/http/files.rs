//! `GET` and `PUT /v1/sandboxes/{id}/files?path=`: files inside a running sandbox.
//!
//! Path: API → NATS request/reply on `{p}.agent.<host>` → hostd → the sandbox's agent; the API
//! never reaches a sandbox address. Each message carries at most [`FILE_CHUNK_BYTES`] of file
//! data, so it stays under NATS's default 1 MiB max payload; a file moves in as many chunks as
//! it needs, up to the operator's limit (`config.limits.max_file_bytes`, 1 GiB by default).
//!
//! # Guarantees
//! - Both directions are streamed one chunk at a time: the API holds at most about two
//!   chunks of a transfer in memory, whatever the file's size. A download asks the host for
//!   the next chunk only when the client has taken the previous one (a slow reader slows its
//!   own download); an upload reads the next piece of the body only after the previous chunk
//!   was written in the sandbox.
//! - An upload is written to a temporary sibling (`.<name>.berth-upload-<uuid>`) and renamed
//!   over the target at the end: a reader never sees half of it. An upload that fails
//!   (too large, a broken body, the host) removes its temporary sibling.
//! - A file over the limit is 413 `payload_too_large`: up front when its size (the upload's
//!   `Content-Length`, the download's stat) says so, else when the limit is passed, which
//!   aborts a download already under way (it is sent chunked, so the client sees a transfer
//!   that broke off, never a short file presented as whole).
//! - Only regular files and directories are read: a device, FIFO or socket is 400 at once
//!   (a read of `/dev/zero` has no end; one of a FIFO blocks).
//! - Transfers count against the org's `max_concurrent_transfers` (429
//!   `too_many_concurrent`).

use std::time::Duration;

use super::extract::StrictQuery;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use berth_schemas::wire::{self, AgentFailure, AgentOp, AgentReply, AgentRequest, FileKind};
use berth_schemas::HostId;
use bytes::BytesMut;
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use tracing::instrument;
use utoipa::{IntoParams, ToSchema};

use crate::auth::Caller;
use crate::error::ApiError;
use crate::limits::{ConcurrencyPermit, Concurrent};
use crate::model::Sandbox;
use crate::AppState;

/// File bytes per NATS message (each way), below NATS's default 1 MiB max payload with room
/// for the envelope.
pub const FILE_CHUNK_BYTES: u32 = 512 * 1024;

/// How long the API waits for the host to answer one file request.
pub const FILE_REQUEST_TIMEOUT: Duration = Duration::from_secs(35);

/// The header of a download that gives the file's size in bytes when the download began.
pub const FILE_SIZE_HEADER: &str = "x-berth-file-size";

/// `?path=`: an absolute path inside the sandbox.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct FileQuery {
    /// Absolute path inside the sandbox.
    pub path: String,
}

impl super::extract::KnownParams for FileQuery {
    const NAMES: &'static [&'static str] = &["path"];
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
        (status = 200, description = "A file's bytes (`application/octet-stream`, streamed; `X-Berth-File-Size`: its size when the download began), or a directory's listing (JSON)", body = DirectoryListing),
        (status = 400, description = "`invalid_request`: a relative path, or not a regular file or directory (a device, FIFO or socket)"),
        (status = 404, description = "`not_found`: no such sandbox or path"),
        (status = 409, description = "`conflict`: the sandbox is not running"),
        (status = 413, description = "`payload_too_large`: the file is over the API's size limit"),
        (status = 429, description = "`too_many_concurrent`: the org's transfers are at their cap"),
        (status = 502, description = "`agent_error`"),
        (status = 503, description = "`host_unavailable`"),
    ), security(("bearer" = [])))]
#[instrument(skip_all, fields(org_id = %caller.org_id, sandbox_id = %id))]
pub async fn get(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    StrictQuery(query): StrictQuery<FileQuery>,
) -> Result<Response, ApiError> {
    let path = absolute(query.path)?;
    let permit = app
        .guards
        .concurrency(caller.org_id, Concurrent::Transfers)?;
    let (sandbox, host) = running(&app, &caller, &id).await?;
    let stat = match call(&app, &sandbox, host, AgentOp::Stat { path: path.clone() }).await? {
        AgentReply::Stat(stat) => stat,
        other => return Err(unexpected(other)),
    };
    match stat.kind {
        FileKind::Dir => {}
        // `Stat` follows links: what is left is a file, or a device, FIFO or socket.
        FileKind::File | FileKind::Symlink => {
            let limit = app.config.limits.max_file_bytes;
            if stat.size > limit {
                return Err(ApiError::PayloadTooLarge { limit });
            }
            // The first chunk is read before the status is sent, so a file the agent cannot
            // read (permissions, a file that vanished) is an error status, not a 200 that
            // breaks off.
            let op = AgentOp::Read {
                path: path.clone(),
                offset: 0,
                len: FILE_CHUNK_BYTES,
            };
            let (first, eof) = match call(&app, &sandbox, host, op).await? {
                AgentReply::Data { data, eof } => (data, eof),
                other => return Err(unexpected(other)),
            };
            if first.len() as u64 > limit {
                return Err(ApiError::PayloadTooLarge { limit });
            }
            metrics::counter!("berth_file_bytes_total", "direction" => "download")
                .increment(first.len() as u64);
            let download = Download {
                app,
                sandbox,
                host,
                path,
                offset: first.len() as u64,
                limit,
                done: eof || first.is_empty(),
                _permit: permit,
            };
            let rest = futures::stream::unfold(download, |mut download| async move {
                let chunk = download.next_chunk().await?;
                Some((chunk, download))
            });
            let chunks = futures::stream::once(async move { Ok(Bytes::from(first)) }).chain(rest);
            return Ok((
                StatusCode::OK,
                [
                    (header::CONTENT_TYPE, "application/octet-stream".to_owned()),
                    // The size when the download began: for a client's progress, not framing
                    // (a file that grows meanwhile streams to its end at the time of reading).
                    (
                        header::HeaderName::from_static(FILE_SIZE_HEADER),
                        stat.size.to_string(),
                    ),
                ],
                Body::from_stream(chunks),
            )
                .into_response());
        }
        FileKind::Other => return Err(not_regular(&path)),
    }
    let entries = match call(&app, &sandbox, host, AgentOp::List { path: path.clone() }).await? {
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
    Ok((StatusCode::OK, Json(listing)).into_response())
}

/// A download in progress: the next chunk is asked for only when the response body is polled
/// for it, i.e. when the client took the previous one.
struct Download {
    app: AppState,
    sandbox: Sandbox,
    host: HostId,
    path: String,
    offset: u64,
    limit: u64,
    done: bool,
    _permit: ConcurrencyPermit,
}

impl Download {
    /// The next chunk, an error that ends the response, or `None` after the end.
    async fn next_chunk(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        if self.done {
            return None;
        }
        let op = AgentOp::Read {
            path: self.path.clone(),
            offset: self.offset,
            len: FILE_CHUNK_BYTES,
        };
        let failed = |what: String| {
            tracing::warn!(error = %what, "download broke off");
            Some(Err(std::io::Error::other(what)))
        };
        match call(&self.app, &self.sandbox, self.host, op).await {
            Ok(AgentReply::Data { data, eof }) => {
                self.offset += data.len() as u64;
                if self.offset > self.limit {
                    self.done = true;
                    return failed(format!(
                        "the file grew past the {}-byte limit while being read",
                        self.limit
                    ));
                }
                self.done = eof || data.is_empty();
                metrics::counter!("berth_file_bytes_total", "direction" => "download")
                    .increment(data.len() as u64);
                Some(Ok(Bytes::from(data)))
            }
            Ok(other) => {
                self.done = true;
                failed(format!("unexpected agent reply {other:?}"))
            }
            Err(e) => {
                self.done = true;
                failed(e.to_string())
            }
        }
    }
}

/// `PUT /v1/sandboxes/{id}/files?path=` with the file's bytes as the body.
#[utoipa::path(put, path = "/v1/sandboxes/{id}/files", params(("id" = String, Path), FileQuery),
    request_body(content = Vec<u8>, content_type = "application/octet-stream"),
    responses(
        (status = 200, description = "Written (parent directories are created)", body = FileWritten),
        (status = 400, description = "`invalid_request`: a relative path, or a body that broke off or paused too long"),
        (status = 404, description = "`not_found`"),
        (status = 409, description = "`conflict`: the sandbox is not running"),
        (status = 413, description = "`payload_too_large`: the body is over the API's size limit"),
        (status = 429, description = "`too_many_concurrent`: the org's transfers are at their cap"),
        (status = 502, description = "`agent_error`"),
        (status = 503, description = "`host_unavailable`"),
    ), security(("bearer" = [])))]
#[instrument(skip_all, fields(org_id = %caller.org_id, sandbox_id = %id))]
pub async fn put(
    State(app): State<AppState>,
    caller: Caller,
    Path(id): Path<String>,
    StrictQuery(query): StrictQuery<FileQuery>,
    headers: HeaderMap,
    body: Body,
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
    let limit = app.config.limits.max_file_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit) {
        return Err(ApiError::PayloadTooLarge { limit });
    }
    let _permit = app
        .guards
        .concurrency(caller.org_id, Concurrent::Transfers)?;
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
    let mut upload = Upload {
        app: &app,
        sandbox: &sandbox,
        host,
        temporary: &temporary,
        written: 0,
    };
    let size = match upload.copy(body, limit, &path).await {
        Ok(size) => size,
        Err(error) => {
            upload.remove_temporary().await;
            return Err(error);
        }
    };
    let written = FileWritten { path, size };
    Ok((StatusCode::OK, Json(written)).into_response())
}

/// An upload into a temporary sibling, chunk by chunk.
struct Upload<'a> {
    app: &'a AppState,
    sandbox: &'a Sandbox,
    host: HostId,
    temporary: &'a str,
    /// Bytes written to the temporary file so far.
    written: u64,
}

impl Upload<'_> {
    /// Streams `body` into the temporary file (at most `limit` bytes), then renames it to
    /// `path`; the size written.
    ///
    /// Errors: [`ApiError::PayloadTooLarge`]; 400 for a body that broke off; the agent's.
    async fn copy(&mut self, body: Body, limit: u64, path: &str) -> Result<u64, ApiError> {
        let chunk = FILE_CHUNK_BYTES as usize;
        let mut pending = BytesMut::with_capacity(chunk);
        let mut body = body.into_data_stream();
        while let Some(piece) = body.next().await {
            let piece = piece
                .map_err(|e| ApiError::invalid("body", format!("the upload broke off: {e}")))?;
            if self.written + (pending.len() + piece.len()) as u64 > limit {
                return Err(ApiError::PayloadTooLarge { limit });
            }
            pending.extend_from_slice(&piece);
            while pending.len() >= chunk {
                let data = pending.split_to(chunk);
                self.write(&data).await?;
            }
        }
        // The rest, or an empty file.
        if !pending.is_empty() || self.written == 0 {
            self.write(&pending).await?;
        }
        let rename = AgentOp::Rename {
            from: self.temporary.to_owned(),
            to: path.to_owned(),
        };
        match call(self.app, self.sandbox, self.host, rename).await? {
            AgentReply::Done => {}
            other => return Err(unexpected(other)),
        }
        metrics::counter!("berth_file_bytes_total", "direction" => "upload")
            .increment(self.written);
        Ok(self.written)
    }

    async fn write(&mut self, data: &[u8]) -> Result<(), ApiError> {
        let op = AgentOp::Write {
            path: self.temporary.to_owned(),
            offset: self.written,
            data: data.to_vec(),
            truncate: self.written == 0,
        };
        match call(self.app, self.sandbox, self.host, op).await? {
            AgentReply::Written { .. } => {}
            other => return Err(unexpected(other)),
        }
        self.written += data.len() as u64;
        Ok(())
    }

    /// Removes the temporary file after a failure (best effort: logged when it fails).
    async fn remove_temporary(&self) {
        let op = AgentOp::Remove {
            path: self.temporary.to_owned(),
        };
        if let Err(e) = call(self.app, self.sandbox, self.host, op).await {
            tracing::warn!(error = %e, path = self.temporary, "upload's temporary file left");
        }
    }
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

fn not_regular(path: &str) -> ApiError {
    ApiError::invalid(
        "path",
        format!("{path} is not a regular file or a directory (a device, FIFO or socket)"),
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
            AgentFailure::NotRegularFile => not_regular("the path"),
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
