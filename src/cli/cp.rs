//! `berth sandbox cp SRC DST`: one file into a sandbox (`PUT …/files`, streamed from disk) or
//! out of one (`GET …/files`, streamed to a temporary file renamed into place, or to stdout),
//! with a progress bar on stderr. A sandbox path is written `ID:/absolute/path`; a local path
//! with a colon before its first `/` needs a `./` in front.
//!
//! Directories are not copied (the API moves files); for a tree, `tar` it with `exec` first.

use std::path::{Path, PathBuf};

use clap::Args;
use futures::StreamExt;
use reqwest::Method;
use tokio::io::AsyncWriteExt;

use super::client::{CliError, Client};
use super::render;
use super::sandbox::segment;
use super::ApiArgs;

/// The header a download's size comes in (`berth_api::http::files::FILE_SIZE_HEADER`).
const FILE_SIZE_HEADER: &str = "x-berth-file-size";

/// `berth sandbox cp`
#[derive(Args, Debug)]
pub struct CpArgs {
    /// What to copy: a local file, or `ID:/path` in a sandbox.
    src: String,
    /// Where to: `ID:/path` (a path ending in `/` takes the source's name), or a local path
    /// (a directory takes the source's name; `-` is stdout).
    dst: String,
}

/// One side of a copy.
#[derive(Debug, PartialEq, Eq)]
enum Place {
    Local(PathBuf),
    Sandbox { id: String, path: String },
}

impl Place {
    /// `ID:/path` is a sandbox's; anything else is local.
    fn parse(text: &str) -> Place {
        match text.split_once(':') {
            Some((id, path)) if !id.is_empty() && !id.contains('/') => Place::Sandbox {
                id: id.to_owned(),
                path: path.to_owned(),
            },
            _ => Place::Local(PathBuf::from(text)),
        }
    }
}

/// Copies; prints nothing on success but the bar (the result with `--json`).
pub async fn cp(client: &Client, api: &ApiArgs, args: CpArgs) -> Result<i32, CliError> {
    match (Place::parse(&args.src), Place::parse(&args.dst)) {
        (Place::Local(src), Place::Sandbox { id, path }) => {
            upload(client, api, &src, &id, &path).await
        }
        (Place::Sandbox { id, path }, Place::Local(dst)) => {
            download(client, &id, &path, &dst).await
        }
        (Place::Local(_), Place::Local(_)) => Err(CliError::Other(
            "one side must be in a sandbox: ID:/path".into(),
        )),
        (Place::Sandbox { .. }, Place::Sandbox { .. }) => Err(CliError::Other(
            "copy between two sandboxes through a local file".into(),
        )),
    }
}

fn file_name(path: &str) -> Option<&str> {
    path.rsplit('/').next().filter(|n| !n.is_empty())
}

async fn upload(
    client: &Client,
    api: &ApiArgs,
    src: &Path,
    id: &str,
    path: &str,
) -> Result<i32, CliError> {
    let local = |e| CliError::other(src.display(), e);
    let file = tokio::fs::File::open(src).await.map_err(local)?;
    let meta = file.metadata().await.map_err(local)?;
    if !meta.is_file() {
        return Err(CliError::Other(format!(
            "{} is not a regular file (cp copies files)",
            src.display()
        )));
    }
    let mut target = path.to_owned();
    if target.ends_with('/') {
        let name = src
            .file_name()
            .ok_or_else(|| CliError::Other(format!("{} has no file name", src.display())))?;
        target.push_str(&name.to_string_lossy());
    }
    let bar = render::bytes_bar(
        Some(meta.len()),
        format!("{} -> {id}:{target}", src.display()),
    );
    let counted = bar.clone();
    let body = tokio_util::io::ReaderStream::new(file).inspect(move |chunk| {
        if let Ok(chunk) = chunk {
            counted.inc(chunk.len() as u64);
        }
    });
    let request = client
        .request(Method::PUT, &format!("/v1/sandboxes/{}/files", segment(id)))
        .query(&[("path", &target)])
        .header(reqwest::header::CONTENT_LENGTH, meta.len())
        .body(reqwest::Body::wrap_stream(body));
    let result = client.send(request).await;
    bar.finish_and_clear();
    let written: serde_json::Value = result?
        .json()
        .await
        .map_err(|e| CliError::other("the API's answer", e))?;
    if api.json {
        print!("{}", render::json(&written));
    }
    Ok(0)
}

async fn download(client: &Client, id: &str, path: &str, dst: &Path) -> Result<i32, CliError> {
    let request = client
        .request(Method::GET, &format!("/v1/sandboxes/{}/files", segment(id)))
        .query(&[("path", path)]);
    let response = client.send(request).await?;
    let is_json = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return Err(CliError::Other(format!(
            "{id}:{path} is a directory (cp copies files)"
        )));
    }
    let size = response
        .headers()
        .get(FILE_SIZE_HEADER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let to_stdout = dst == Path::new("-");
    let target = if !to_stdout && dst.is_dir() {
        let name =
            file_name(path).ok_or_else(|| CliError::Other(format!("{path} has no file name")))?;
        dst.join(name)
    } else {
        dst.to_owned()
    };
    let bar = render::bytes_bar(size, format!("{id}:{path} -> {}", target.display()));
    let mut body = response.bytes_stream();
    if to_stdout {
        let mut out = tokio::io::stdout();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| CliError::other("the download broke off", e))?;
            out.write_all(&chunk)
                .await
                .map_err(|e| CliError::other("stdout", e))?;
            bar.inc(chunk.len() as u64);
        }
        out.flush()
            .await
            .map_err(|e| CliError::other("stdout", e))?;
        bar.finish_and_clear();
        return Ok(0);
    }
    // Written beside the target and renamed into place: a broken download leaves no half file.
    let partial = target.with_file_name(format!(
        ".{}.berth-partial",
        target
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    ));
    let local = |e| CliError::other(partial.display(), e);
    let mut file = tokio::fs::File::create(&partial).await.map_err(local)?;
    let copied = async {
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| CliError::other("the download broke off", e))?;
            file.write_all(&chunk).await.map_err(local)?;
            bar.inc(chunk.len() as u64);
        }
        file.sync_all().await.map_err(local)?;
        tokio::fs::rename(&partial, &target)
            .await
            .map_err(|e| CliError::other(target.display(), e))
    }
    .await;
    bar.finish_and_clear();
    if copied.is_err() {
        let _ = tokio::fs::remove_file(&partial).await;
    }
    copied.map(|()| 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_place_is_a_sandbox_s_when_an_id_and_a_colon_come_first() {
        assert_eq!(
            Place::parse("abc:/root/f"),
            Place::Sandbox {
                id: "abc".into(),
                path: "/root/f".into()
            }
        );
        assert_eq!(Place::parse("./a:b"), Place::Local("./a:b".into()));
        assert_eq!(Place::parse("/tmp/f"), Place::Local("/tmp/f".into()));
        assert_eq!(Place::parse(":x"), Place::Local(":x".into()));
    }
}
