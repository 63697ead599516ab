//! `berth sandbox create|ls|get|stop|start|archive|rm|events|preview` and `berth template ls`: one
//! request each (a list follows its pages), waits done by the API (`?wait=`) under a spinner.

use std::io::Write;

use clap::Args;
use futures::StreamExt;
use reqwest::Method;
use serde_json::{json, Map, Value};

use super::client::{CliError, Client};
use super::render;
use super::ApiArgs;

/// How long a create or a lifecycle request waits for its state (the API's longest wait).
pub const WAIT_TIMEOUT: &str = "300s";

/// The page size a list asks for (the API's largest).
const LIST_PAGE: u32 = 500;

/// `berth sandbox create`
#[derive(Args, Debug)]
pub struct CreateArgs {
    /// The template (`berth template ls`).
    #[arg(long, short, default_value = "base")]
    template: String,
    /// vCPUs (default: the API's).
    #[arg(long)]
    vcpus: Option<u32>,
    /// Memory in MiB (default: the API's).
    #[arg(long)]
    memory_mib: Option<u32>,
    /// Writable disk in MiB (default: the operator's).
    #[arg(long)]
    disk_mib: Option<u32>,
    /// Metadata, KEY=VALUE (repeatable).
    #[arg(long = "metadata", short = 'm', value_parser = key_value)]
    metadata: Vec<(String, String)>,
    /// Stop after this many idle minutes.
    #[arg(long)]
    auto_stop_minutes: Option<u32>,
    /// A port anyone may reach through the preview proxy without a key (repeatable).
    #[arg(long = "public-port")]
    public_ports: Vec<u16>,
    /// Return at once with the sandbox `provisioning`.
    #[arg(long)]
    no_wait: bool,
}

/// `berth sandbox ls`
#[derive(Args, Debug)]
pub struct ListArgs {
    /// Only sandboxes in this state (`deleted` lists tombstones).
    #[arg(long)]
    state: Option<String>,
    /// Only sandboxes with this metadata, KEY=VALUE (repeatable; all must match).
    #[arg(long = "metadata", short = 'm', value_parser = key_value)]
    metadata: Vec<(String, String)>,
}

/// `berth sandbox stop|start|archive|rm`
#[derive(Args, Debug)]
pub struct LifecycleArgs {
    /// The sandboxes' ids.
    #[arg(required = true)]
    ids: Vec<String>,
    /// Return once the request is accepted, without waiting for the state.
    #[arg(long)]
    no_wait: bool,
}

/// `berth sandbox events`
#[derive(Args, Debug)]
pub struct EventsArgs {
    /// The sandbox's id.
    id: String,
    /// After the history, stream new events as they happen (until interrupted).
    #[arg(long, short)]
    follow: bool,
}

/// `berth sandbox preview`
#[derive(Args, Debug)]
pub struct PreviewArgs {
    /// The sandbox's id.
    id: String,
    /// The port inside the sandbox.
    port: u16,
    /// How long the token is valid (`10m`, `2h`; default: the API's).
    #[arg(long)]
    ttl: Option<humantime::Duration>,
}

/// `KEY=VALUE`.
pub fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .filter(|(k, _)| !k.is_empty())
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

fn print(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
}

/// `berth sandbox create`: prints the id (the sandbox with `--json`).
pub async fn create(client: &Client, api: &ApiArgs, args: CreateArgs) -> Result<i32, CliError> {
    let mut body = json!({ "template": args.template });
    let fields = [
        ("vcpus", args.vcpus),
        ("memory_mib", args.memory_mib),
        ("disk_mib", args.disk_mib),
        ("auto_stop_minutes", args.auto_stop_minutes),
    ];
    for (name, value) in fields {
        if let Some(value) = value {
            body[name] = json!(value);
        }
    }
    if !args.metadata.is_empty() {
        let map: Map<String, Value> = args
            .metadata
            .into_iter()
            .map(|(k, v)| (k, Value::String(v)))
            .collect();
        body["metadata"] = Value::Object(map);
    }
    if !args.public_ports.is_empty() {
        body["public_ports"] = json!(args.public_ports);
    }
    let path = if args.no_wait {
        "/v1/sandboxes".to_owned()
    } else {
        format!("/v1/sandboxes?wait=running&timeout={WAIT_TIMEOUT}")
    };
    let spinner = render::spinner(format!("creating a {} sandbox", body["template"]));
    let created = client.json(Method::POST, &path, Some(&body)).await;
    spinner.finish_and_clear();
    let created = created?;
    if api.json {
        print(&render::json(&created));
    } else {
        print(&format!("{}\n", render::cell(&created["id"])));
    }
    Ok(0)
}

/// `berth sandbox ls`: every page.
pub async fn list(client: &Client, api: &ApiArgs, args: ListArgs) -> Result<i32, CliError> {
    let mut query: Vec<(String, String)> = vec![("limit".into(), LIST_PAGE.to_string())];
    if let Some(state) = args.state {
        query.push(("state".into(), state));
    }
    for (k, v) in args.metadata {
        query.push((format!("metadata.{k}"), v));
    }
    let mut all = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut page_query = query.clone();
        if let Some(cursor) = &cursor {
            page_query.push(("cursor".into(), cursor.clone()));
        }
        let request = client
            .request(Method::GET, "/v1/sandboxes")
            .query(&page_query)
            .timeout(super::client::REQUEST_TIMEOUT);
        let page: Value = client
            .send(request)
            .await?
            .json()
            .await
            .map_err(|e| CliError::other("the API's answer", e))?;
        if let Some(items) = page["sandboxes"].as_array() {
            all.extend(items.iter().cloned());
        }
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    if api.json {
        print(&render::json(&Value::Array(all)));
    } else {
        let rows: Vec<Vec<String>> = all.iter().map(render::sandbox_row).collect();
        print(&render::table(&render::SANDBOX_COLUMNS, &rows));
    }
    Ok(0)
}

/// `berth sandbox get`
pub async fn get(client: &Client, api: &ApiArgs, id: &str) -> Result<i32, CliError> {
    let sandbox = client
        .json(Method::GET, &format!("/v1/sandboxes/{}", segment(id)), None)
        .await?;
    if api.json {
        print(&render::json(&sandbox));
    } else {
        print(&render::sandbox_detail(&sandbox));
    }
    Ok(0)
}

/// A lifecycle request of `berth sandbox stop|start|archive|rm`.
#[derive(Debug, Clone, Copy)]
pub enum Action {
    /// `POST …/stop?wait=stopped`
    Stop,
    /// `POST …/start?wait=running`
    Start,
    /// `POST …/archive?wait=archived`
    Archive,
    /// `DELETE …?wait=deleted`
    Delete,
}

/// `berth sandbox stop|start|archive|rm`: one request per sandbox, in order; stops at the first error.
/// Prints `<id> <state>` per sandbox (the sandboxes with `--json`).
pub async fn lifecycle(
    client: &Client,
    api: &ApiArgs,
    action: Action,
    args: LifecycleArgs,
) -> Result<i32, CliError> {
    let (method, suffix, target, verb) = match action {
        Action::Stop => (Method::POST, "/stop", "stopped", "stopping"),
        Action::Start => (Method::POST, "/start", "running", "starting"),
        Action::Archive => (Method::POST, "/archive", "archived", "archiving"),
        Action::Delete => (Method::DELETE, "", "deleted", "deleting"),
    };
    let mut done = Vec::new();
    for id in &args.ids {
        let mut path = format!("/v1/sandboxes/{}{suffix}", segment(id));
        if !args.no_wait {
            path.push_str(&format!("?wait={target}&timeout={WAIT_TIMEOUT}"));
        }
        let spinner = render::spinner(format!("{verb} {id}"));
        let answer = client.json(method.clone(), &path, None).await;
        spinner.finish_and_clear();
        let sandbox = answer?;
        if !api.json {
            print(&format!(
                "{} {}\n",
                render::cell(&sandbox["id"]),
                render::cell(&sandbox["state"])
            ));
        }
        done.push(sandbox);
    }
    if api.json {
        print(&render::json(&Value::Array(done)));
    }
    Ok(0)
}

/// The columns of `berth sandbox events`.
const EVENT_COLUMNS: [&str; 5] = ["AT", "KIND", "FROM", "TO", "REASON"];

/// `berth sandbox events [--follow]`
pub async fn events(client: &Client, api: &ApiArgs, args: EventsArgs) -> Result<i32, CliError> {
    let history = client
        .json(
            Method::GET,
            &format!("/v1/sandboxes/{}/events", segment(&args.id)),
            None,
        )
        .await?;
    let items = history.as_array().cloned().unwrap_or_default();
    if api.json && !args.follow {
        print(&render::json(&history));
    } else if api.json {
        for event in &items {
            print(&format!("{event}\n"));
        }
    } else {
        let rows: Vec<Vec<String>> = items
            .iter()
            .map(|e| {
                vec![
                    render::cell(&e["at"]),
                    render::cell(&e["kind"]),
                    render::cell(&e["from"]),
                    render::cell(&e["to"]),
                    render::cell(&e["reason"]),
                ]
            })
            .collect();
        print(&render::table(&EVENT_COLUMNS, &rows));
    }
    if !args.follow {
        return Ok(0);
    }
    follow(client, api, &args.id, items.last()).await
}

/// Streams the sandbox's new events from `GET /v1/events` (SSE), from after `last` (the
/// newest of the history), one line each, until the stream ends or the user interrupts.
async fn follow(
    client: &Client,
    api: &ApiArgs,
    id: &str,
    last: Option<&Value>,
) -> Result<i32, CliError> {
    let mut request = client
        .request(Method::GET, "/v1/events")
        .query(&[("sandbox_id", id)]);
    if let Some(last) = last.and_then(|e| e["id"].as_str()) {
        request = request.header("Last-Event-ID", last);
    }
    let response = client.send(request).await?;
    let mut body = response.bytes_stream();
    let mut pending: Vec<u8> = Vec::new();
    while let Some(chunk) = body.next().await {
        let chunk = chunk.map_err(|e| CliError::other("the event stream", e))?;
        pending.extend_from_slice(&chunk);
        if pending.len() > MAX_SSE_EVENT_BYTES {
            return Err(CliError::Other("an event over the size limit".into()));
        }
        while let Some(end) = find(&pending, b"\n\n") {
            let event: Vec<u8> = pending.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&event);
            for data in text.lines().filter_map(|l| l.strip_prefix("data:")) {
                let Ok(value) = serde_json::from_str::<Value>(data.trim()) else {
                    continue;
                };
                if api.json {
                    print(&format!("{value}\n"));
                } else {
                    let d = &value["data"];
                    print(&format!(
                        "{}  {}  {} -> {}  {}\n",
                        render::cell(&value["time"]),
                        render::cell(&value["type"]),
                        render::cell(&d["from"]),
                        render::cell(&d["to"]),
                        render::cell(&d["reason"]),
                    ));
                }
            }
        }
    }
    Ok(0)
}

/// The largest server-sent event the CLI holds while reading it.
const MAX_SSE_EVENT_BYTES: usize = 1024 * 1024;

fn find(haystack: &[u8], needle: &[u8]) -> Option<usize> {
    haystack.windows(needle.len()).position(|w| w == needle)
}

/// `berth sandbox preview`: prints the URL (URL, token and expiry with `--json`).
pub async fn preview(client: &Client, api: &ApiArgs, args: PreviewArgs) -> Result<i32, CliError> {
    let body = match args.ttl {
        Some(ttl) => json!({ "ttl_seconds": ttl.as_secs() }),
        None => json!({}),
    };
    let token = client
        .json(
            Method::POST,
            &format!(
                "/v1/sandboxes/{}/ports/{}/token",
                segment(&args.id),
                args.port
            ),
            Some(&body),
        )
        .await?;
    if api.json {
        print(&render::json(&token));
    } else {
        print(&render::table(
            &["URL", "TOKEN", "EXPIRES"],
            &[vec![
                render::cell(&token["url"]),
                render::cell(&token["token"]),
                render::cell(&token["expires_at"]),
            ]],
        ));
    }
    Ok(0)
}

/// `berth template ls`: name, runtime, state (`ready`, `pulling`, `failed`), the image a
/// pulled template comes from (`-` for built-in and imported ones), description.
pub async fn templates(client: &Client, api: &ApiArgs) -> Result<i32, CliError> {
    let list = client.json(Method::GET, "/v1/templates", None).await?;
    if api.json {
        print(&render::json(&list));
    } else {
        let rows: Vec<Vec<String>> = list
            .as_array()
            .map(|items| {
                items
                    .iter()
                    .map(|t| {
                        vec![
                            render::cell(&t["name"]),
                            render::cell(&t["runtime"]),
                            render::cell(&t["state"]),
                            render::cell(&t["image"]),
                            render::cell(&t["description"]),
                        ]
                    })
                    .collect()
            })
            .unwrap_or_default();
        print(&render::table(
            &["NAME", "RUNTIME", "STATE", "IMAGE", "DESCRIPTION"],
            &rows,
        ));
    }
    Ok(0)
}

/// `id` as one path segment: anything but an id's own characters is percent-encoded, so a
/// typo cannot reach another route.
pub fn segment(id: &str) -> String {
    let mut out = String::new();
    for b in id.bytes() {
        if b.is_ascii_alphanumeric() || b == b'-' || b == b'_' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}
