//! The API's memory stays bounded whatever a client or a sandbox does (issue 11 item 5): a
//! stalled `exec/stream` reader and a file larger than the old 64 MiB limit, measured on a
//! spawned `berth api` process's resident memory; uploads over the limit; reads of devices
//! and FIFOs; a delete during an exec; the per-org caps on concurrent streams, transfers and
//! execs.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use reqwest::Method;
use serde_json::json;
use sqlx::PgPool;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::api_process::ApiProcess;
use crate::support::{eventually, Stack};

const MIB: u64 = 1 << 20;

/// How much the API process may grow while a stalled stream's process writes as fast as it
/// can for its whole timeout. Before flow control it grew by hundreds of MiB in seconds
/// (92 MB → 1.28 GB in the report).
const STALLED_STREAM_GROWTH_BOUND: u64 = 64 * MIB;

/// Bytes of the big round trip: more than the old 64 MiB limit.
const BIG_FILE_BYTES: usize = 80 * (1 << 20);

/// How much the API process may grow while it moves [`BIG_FILE_BYTES`] each way: well under
/// the file's size (it used to hold the whole body, then the whole download).
const TRANSFER_GROWTH_BOUND: u64 = 40 * MIB;

/// Records the highest resident memory of `pid` until the returned flag is set.
fn watch_peak_rss(pid: u32) -> (Arc<AtomicU64>, tokio_util::sync::CancellationToken) {
    let peak = Arc::new(AtomicU64::new(0));
    let stop = tokio_util::sync::CancellationToken::new();
    let (p, s) = (peak.clone(), stop.clone());
    tokio::spawn(async move {
        while !s.is_cancelled() {
            p.fetch_max(
                crate::support::api_process::rss_bytes(pid),
                Ordering::Relaxed,
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    });
    (peak, stop)
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_stalled_exec_stream_reader_does_not_grow_the_api_process(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    let api = ApiProcess::spawn(&stack, &[]).await;
    // Warm up: one stream read to its end, so the baseline includes what a stream allocates.
    let warm = stack
        .http
        .post(api.url(&format!("/v1/sandboxes/{id}/exec/stream")))
        .bearer_auth(&stack.key)
        .json(&json!({"cmd": ["sh", "-c", "head -c 1000000 /dev/zero | tr '\\0' x"]}))
        .send()
        .await
        .unwrap();
    assert_eq!(warm.status(), 200);
    let text = warm.text().await.unwrap();
    assert!(
        text.contains("\"exit_code\":0"),
        "{}",
        &text[text.len() - 200..]
    );
    let baseline = api.rss_bytes();
    let (peak, stop_watch) = watch_peak_rss(api.pid);

    // A client that sends its request and never reads a byte, while `yes` writes as fast as
    // it can for 20 s.
    let address = api.base.trim_start_matches("http://").to_owned();
    let mut stalled = tokio::net::TcpStream::connect(&address).await.unwrap();
    let body = json!({"cmd": ["yes", "0123456789abcdef0123456789abcdef"], "timeout_ms": 20_000})
        .to_string();
    let request = format!(
        "POST /v1/sandboxes/{id}/exec/stream HTTP/1.1\r\nHost: {address}\r\n\
         Authorization: Bearer {}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        stack.key,
        body.len()
    );
    stalled.write_all(request.as_bytes()).await.unwrap();
    eventually("the stalled stream's process runs", || async {
        let (_, out) = stack.exec(&id, &["pidof", "yes"]).await;
        out["exit_code"] == 0
    })
    .await;
    // It ends at its timeout (the agent kills it), whether its output went anywhere or not.
    eventually(
        "the stalled stream's process ended at its timeout",
        || async {
            let (_, out) = stack.exec(&id, &["pidof", "yes"]).await;
            out["exit_code"] == 1
        },
    )
    .await;
    stop_watch.cancel();
    let now = api.rss_bytes();
    let peak = peak.load(Ordering::Relaxed).max(now);
    eprintln!(
        "api rss: baseline {} MiB, peak {} MiB, after {} MiB",
        baseline / MIB,
        peak / MIB,
        now / MIB
    );
    assert!(
        peak.saturating_sub(baseline) < STALLED_STREAM_GROWTH_BOUND,
        "the API grew from {baseline} to {peak} bytes behind a stalled reader"
    );
    drop(stalled);

    // A reader that reads gets the whole output, in order, and the exit.
    let read = stack
        .http
        .post(api.url(&format!("/v1/sandboxes/{id}/exec/stream")))
        .bearer_auth(&stack.key)
        .json(&json!({"cmd": ["sh", "-c", "seq 1 200000"]}))
        .send()
        .await
        .unwrap();
    let text = read.text().await.unwrap();
    let mut stdout = String::new();
    for line in text.lines() {
        let value: serde_json::Value = serde_json::from_str(line).unwrap();
        if let Some(s) = value["stdout"].as_str() {
            stdout.push_str(s);
        } else {
            assert_eq!(value["exit_code"], 0, "{value}");
        }
    }
    let expected: String = (1..=200_000).map(|i| format!("{i}\n")).collect();
    assert!(stdout == expected, "the streamed output differs");
    drop(api);
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_file_larger_than_the_old_limit_round_trips_without_growing_the_api(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    let limit = 96 * MIB;
    let api = ApiProcess::spawn(&stack, &["--max-file-bytes", &limit.to_string()]).await;
    let url = api.url(&format!("/v1/sandboxes/{id}/files?path=/root/big.bin"));
    let data = crate::io::pattern(BIG_FILE_BYTES);
    let baseline = api.rss_bytes();
    let (peak, stop_watch) = watch_peak_rss(api.pid);

    let put = stack
        .http
        .put(&url)
        .bearer_auth(&stack.key)
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(put.status(), 200, "{}", put.text().await.unwrap());
    let got = stack
        .http
        .get(&url)
        .bearer_auth(&stack.key)
        .send()
        .await
        .unwrap();
    assert_eq!(got.status(), 200);
    let back = got.bytes().await.unwrap();
    stop_watch.cancel();
    let peak = peak.load(Ordering::Relaxed);
    eprintln!(
        "api rss moving {} MiB each way: baseline {} MiB, peak {} MiB",
        BIG_FILE_BYTES as u64 / MIB,
        baseline / MIB,
        peak / MIB
    );
    assert_eq!(back.len(), data.len());
    assert!(back.as_ref() == data.as_slice(), "the bytes differ");
    assert!(
        peak.saturating_sub(baseline) < TRANSFER_GROWTH_BOUND,
        "the API grew from {baseline} to {peak} bytes moving an {BIG_FILE_BYTES}-byte file"
    );

    // A body declared over the limit is refused before it is read.
    let address = api.base.trim_start_matches("http://").to_owned();
    let mut client = tokio::net::TcpStream::connect(&address).await.unwrap();
    let request = format!(
        "PUT /v1/sandboxes/{id}/files?path=/root/huge.bin HTTP/1.1\r\nHost: {address}\r\n\
         Authorization: Bearer {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        stack.key,
        limit + 1
    );
    client.write_all(request.as_bytes()).await.unwrap();
    let mut answer = String::new();
    client.read_to_string(&mut answer).await.unwrap();
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("\"payload_too_large\""), "{answer}");
    drop(api);
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn uploads_over_the_limit_devices_fifos_deletes_mid_exec_and_the_org_caps(db: PgPool) {
    let stack = Stack::start_configured(
        db,
        1,
        berth_reconciler::pass::PassConfig::default(),
        |config| {
            config.limits.max_file_bytes = MIB;
            config.limits.org_max_streams = 1;
            config.limits.org_max_transfers = 1;
            config.limits.org_max_execs = 2;
        },
    )
    .await;
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;

    // A chunked upload (no Content-Length) one byte over the limit: 413, and its temporary
    // sibling is removed.
    let over = crate::io::pattern(MIB as usize + 1);
    let address = stack.base.trim_start_matches("http://").to_owned();
    let mut client = tokio::net::TcpStream::connect(&address).await.unwrap();
    let head = format!(
        "PUT /v1/sandboxes/{id}/files?path=/root/up/over.bin HTTP/1.1\r\nHost: {address}\r\n\
         Authorization: Bearer {}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n",
        stack.key
    );
    // The whole chunked body in one write: the byte that passes the limit comes last, with
    // the terminator, so the server has read everything when it answers and closes.
    let mut request = head.into_bytes();
    for piece in over.chunks(100_000) {
        request.extend_from_slice(format!("{:x}\r\n", piece.len()).as_bytes());
        request.extend_from_slice(piece);
        request.extend_from_slice(b"\r\n");
    }
    request.extend_from_slice(b"0\r\n\r\n");
    client.write_all(&request).await.unwrap();
    let mut answer = Vec::new();
    let _ = client.read_to_end(&mut answer).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.contains("\"payload_too_large\""), "{answer}");
    let (_, out) = stack.exec(&id, &["ls", "-a", "/root/up"]).await;
    let listing = out["stdout"].as_str().unwrap_or_default().to_owned();
    assert!(!listing.contains("berth-upload"), "left: {listing}");
    assert!(!listing.contains("over.bin"), "written: {listing}");
    // At the limit it passes.
    let (status, body) = {
        let put = stack
            .http
            .put(stack.url(&format!("/v1/sandboxes/{id}/files?path=/root/up/at.bin")))
            .bearer_auth(&stack.key)
            .body(over[..MIB as usize].to_vec())
            .send()
            .await
            .unwrap();
        (put.status(), put.text().await.unwrap())
    };
    assert_eq!(status, 200, "{body}");

    // One transfer at a time: an upload whose body stalls holds the org's slot, and a
    // download meanwhile is 429; once the upload's connection closes, downloads pass again.
    let mut stalled_upload = tokio::net::TcpStream::connect(&address).await.unwrap();
    stalled_upload
        .write_all(
            format!(
                "PUT /v1/sandboxes/{id}/files?path=/root/up/slow.bin HTTP/1.1\r\nHost: {address}\r\n\
                 Authorization: Bearer {}\r\nContent-Length: 1000\r\n\r\n0123456789",
                stack.key
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    let download = format!("/v1/sandboxes/{id}/files?path=/root/up/at.bin");
    let refused = std::sync::Mutex::new(None);
    eventually(
        "a download is refused while the upload holds the slot",
        || async {
            let (status, body) = stack.call(Method::GET, &download, None).await;
            if status == 429 {
                *refused.lock().unwrap() = Some(body);
            }
            status == 429
        },
    )
    .await;
    let refused = refused.into_inner().unwrap().unwrap();
    assert_eq!(refused["error"]["code"], "too_many_concurrent", "{refused}");
    assert_eq!(
        refused["error"]["limit"], "max_concurrent_transfers",
        "{refused}"
    );
    drop(stalled_upload);
    eventually("a download passes once the upload is gone", || async {
        let (status, _) = stack.call(Method::GET, &download, None).await;
        status == 200
    })
    .await;

    // A device or a FIFO is refused at once, not read for 512 KiB or waited on for 30 s.
    let (_, out) = stack.exec(&id, &["mkfifo", "/root/fifo"]).await;
    assert_eq!(out["exit_code"], 0, "{out}");
    for path in ["/dev/zero", "/root/fifo"] {
        let (status, body) = stack
            .call(
                Method::GET,
                &format!("/v1/sandboxes/{id}/files?path={path}"),
                None,
            )
            .await;
        assert_eq!(status, 400, "{path}: {body}");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("not a regular file"),
            "{body}"
        );
    }

    // A file the agent cannot read (the agent's own environment: it is non-dumpable) is an
    // error status with a JSON body, not a 200 that breaks off (found by a break-it run).
    let (status, body) = stack
        .call(
            Method::GET,
            &format!("/v1/sandboxes/{id}/files?path=/proc/1/environ"),
            None,
        )
        .await;
    assert!(status >= 400, "{status}: {body}");
    assert!(body["error"]["code"].is_string(), "{body}");

    // One stream at a time for this org: a second is 429 while the first runs.
    let first = stack
        .http
        .post(stack.url(&format!("/v1/sandboxes/{id}/exec/stream")))
        .bearer_auth(&stack.key)
        .json(&json!({"cmd": ["sh", "-c", "echo started; sleep 600"], "timeout_ms": 600_000}))
        .send()
        .await
        .unwrap();
    assert_eq!(first.status(), 200);
    let (status, body) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{id}/exec/stream"),
            Some(json!({"cmd": ["true"]})),
        )
        .await;
    assert_eq!(status, 429, "{body}");
    assert_eq!(body["error"]["code"], "too_many_concurrent", "{body}");
    assert_eq!(body["error"]["limit"], "max_concurrent_streams", "{body}");

    // Deleting the sandbox under a running exec ends it with a clean conflict, not a 502.
    let exec = {
        let http = stack.http.clone();
        let url = stack.url(&format!("/v1/sandboxes/{id}/exec"));
        let key = stack.key.clone();
        tokio::spawn(async move {
            let response = http
                .post(url)
                .bearer_auth(key)
                .json(&json!({"cmd": ["sleep", "600"], "timeout_ms": 600_000}))
                .send()
                .await
                .unwrap();
            let status = response.status().as_u16();
            (status, response.json::<serde_json::Value>().await.unwrap())
        })
    };
    eventually("the exec runs", || async {
        let (_, out) = stack.exec(&id, &["pidof", "sleep"]).await;
        out["stdout"]
            .as_str()
            .unwrap_or_default()
            .split_whitespace()
            .count()
            >= 2
    })
    .await;
    // Two execs at a time: with a second long one in flight, a third is 429. (Seen by a file
    // it writes, not by an exec, which would itself take a slot.)
    let second = {
        let http = stack.http.clone();
        let url = stack.url(&format!("/v1/sandboxes/{id}/exec"));
        let key = stack.key.clone();
        tokio::spawn(async move {
            let response = http
                .post(url)
                .bearer_auth(key)
                .json(&json!({
                    "cmd": ["sh", "-c", "touch /root/second; exec sleep 600"],
                    "timeout_ms": 600_000
                }))
                .send()
                .await
                .unwrap();
            response.status().as_u16()
        })
    };
    eventually("the second exec runs", || async {
        let (status, _) = stack
            .call(
                Method::GET,
                &format!("/v1/sandboxes/{id}/files?path=/root/second"),
                None,
            )
            .await;
        status == 200
    })
    .await;
    let (status, refused) = stack.exec(&id, &["true"]).await;
    assert_eq!(status, 429, "{refused}");
    assert_eq!(refused["error"]["code"], "too_many_concurrent", "{refused}");
    assert_eq!(
        refused["error"]["limit"], "max_concurrent_execs",
        "{refused}"
    );
    let (status, _) = stack.delete(&id).await;
    assert_eq!(status, 202);
    assert_eq!(second.await.unwrap(), 409);
    let (status, body) = exec.await.unwrap();
    assert_eq!(status, 409, "{body}");
    assert_eq!(body["error"]["code"], "conflict", "{body}");
    // The stream the delete cut ends with a conflict line; its slot comes back.
    let text = first.text().await.unwrap();
    let last = text.lines().last().unwrap();
    assert!(last.contains("\"conflict\""), "{text}");
    stack.wait_state(&id, "deleted").await;
    let other = stack.create().await;
    stack.wait_state(&other, "running").await;
    let (status, body) = stack
        .call(
            Method::POST,
            &format!("/v1/sandboxes/{other}/exec/stream"),
            Some(json!({"cmd": ["true"]})),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    stack.delete(&other).await;
    stack.wait_state(&other, "deleted").await;
    stack.teardown().await;
}
