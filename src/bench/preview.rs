//! `berth bench`'s preview figures: a request through the preview proxy against the same
//! request made directly to the sandbox's address from its host (the forwarder's own last
//! hop, over the sandbox's veth), requests per second through the proxy, and the latency of a
//! request that wakes a stopped sandbox (stopped → first byte) on runc and on gVisor.
//!
//! The sandbox serves a small file with busybox's httpd on [`PORT`]. A runc sandbox boots
//! from its disk after a stop, so its woken server is gone: its wake figure ends at the
//! proxy's first byte (a 502 page); a gVisor sandbox keeps the server and answers 200.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::json;

use super::{ms, ratio_p50, Client, Samples};

/// The port the bench's web server listens on inside the sandbox.
const PORT: u16 = 8000;
/// Round trips measured each way.
const ROUND_TRIPS: usize = 200;
/// Requests in the throughput phase, and how many are in flight at once.
const THROUGHPUT_REQUESTS: usize = 2000;
const THROUGHPUT_CONCURRENCY: usize = 16;
/// Wakes measured per runtime.
const WAKES: usize = 5;

/// Where the proxy is and which domain it serves.
pub struct ProxyTarget {
    /// `http://127.0.0.1:8090`.
    pub url: String,
    /// The preview domain (`preview.localhost:8090`).
    pub domain: String,
}

/// Measures and prints the preview rows.
pub async fn run(client: &Client, proxy: &ProxyTarget) -> anyhow::Result<()> {
    let (id, address) = web_sandbox(client, "base").await?;
    let host = format!("{PORT}-{id}.{}", proxy.domain);
    let http = reqwest::Client::new();
    let via_proxy = || {
        http.get(format!("{}/", proxy.url))
            .header(reqwest::header::HOST, host.clone())
            .bearer_auth(&client.key)
    };
    let direct_url = format!("http://{address}:{PORT}/");
    let mut proxied = Samples::default();
    let mut direct = Samples::default();
    for _ in 0..ROUND_TRIPS {
        let t = Instant::now();
        let r = via_proxy().send().await?;
        if r.status() != 200 {
            bail!("proxied request: {}", r.status());
        }
        r.bytes().await?;
        proxied.push(t.elapsed());
        let t = Instant::now();
        http.get(&direct_url).send().await?.bytes().await?;
        direct.push(t.elapsed());
    }

    let started = Instant::now();
    let statuses = futures::future::join_all((0..THROUGHPUT_CONCURRENCY).map(|_| async {
        let mut ok = 0usize;
        for _ in 0..THROUGHPUT_REQUESTS / THROUGHPUT_CONCURRENCY {
            if let Ok(r) = via_proxy().send().await {
                if r.status() == 200 && r.bytes().await.is_ok() {
                    ok += 1;
                }
            }
        }
        ok
    }))
    .await;
    let elapsed = started.elapsed();
    let ok: usize = statuses.iter().sum();
    client.delete(&id).await?;

    let runc_wake = wakes(client, proxy, "base").await?;
    let gvisor_wake = wakes(client, proxy, "base-gvisor").await?;

    println!();
    println!("| preview | n | p50 ms | p95 ms | p99 ms | direct p50 ms | ratio p50 |");
    println!("|---|---|---|---|---|---|---|");
    let ratio = ratio_p50(&proxied, &direct);
    println!(
        "| proxied GET (by host name) | {} | {} | {} | {} | {} | {ratio} |",
        proxied.0.len(),
        ms(proxied.quantile(0.5)),
        ms(proxied.quantile(0.95)),
        ms(proxied.quantile(0.99)),
        ms(direct.quantile(0.5)),
    );
    for (name, s) in [
        ("wake on request, runc (stopped → first byte)", &runc_wake),
        (
            "wake on request, gVisor (stopped → first byte)",
            &gvisor_wake,
        ),
    ] {
        println!(
            "| {name} | {} | {} | {} | {} | — | — |",
            s.0.len(),
            ms(s.quantile(0.5)),
            ms(s.quantile(0.95)),
            ms(s.quantile(0.99)),
        );
    }
    println!();
    println!(
        "preview throughput: {ok} of {THROUGHPUT_REQUESTS} GETs answered 200 with {THROUGHPUT_CONCURRENCY} in flight in {:.2} s: {:.0} requests/s",
        elapsed.as_secs_f64(),
        ok as f64 / elapsed.as_secs_f64()
    );
    Ok(())
}

/// A running sandbox of `template` serving a small file on [`PORT`]; its id and address.
async fn web_sandbox(client: &Client, template: &str) -> anyhow::Result<(String, String)> {
    let (_, id) = client
        .transition(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": template, "vcpus": 1, "memory_mib": 128})),
            None,
            "running",
        )
        .await?;
    let (status, out) = client
        .send(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({"cmd": ["sh", "-c",
                "mkdir -p /srv && echo hello > /srv/index.html && busybox httpd -p 8000 -h /srv </dev/null >/dev/null 2>&1"]})),
        )
        .await?;
    if status != 200 || out["exit_code"] != 0 {
        bail!("starting httpd in {id}: {status} {out}");
    }
    let (_, sandbox) = client
        .send(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
        .await?;
    let address = sandbox["address"]
        .as_str()
        .context("a running sandbox has an address")?
        .to_owned();
    Ok((id, address))
}

/// Stops a fresh `template` sandbox [`WAKES`] times and times the request that wakes it.
async fn wakes(client: &Client, proxy: &ProxyTarget, template: &str) -> anyhow::Result<Samples> {
    let (id, _) = web_sandbox(client, template).await?;
    let host = format!("{PORT}-{id}.{}", proxy.domain);
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()?;
    let mut samples = Samples::default();
    for _ in 0..WAKES {
        client
            .transition(
                reqwest::Method::POST,
                &format!("/v1/sandboxes/{id}/stop"),
                None,
                Some(&id),
                "stopped",
            )
            .await?;
        let t = Instant::now();
        let r = http
            .get(format!("{}/", proxy.url))
            .header(reqwest::header::HOST, host.clone())
            .bearer_auth(&client.key)
            .send()
            .await?;
        samples.push(t.elapsed());
        if !(r.status() == 200 || r.status() == 502) {
            bail!("waking {id}: {}", r.status());
        }
    }
    client.delete(&id).await?;
    Ok(samples)
}
