//! `berth template pull NAME IMAGE`: `POST /v1/templates`, then a spinner showing the pull's
//! latest event until the template is `ready` (prints its name and digest, or the template as
//! JSON with `--json`) or `failed` (the pull's code and message, exit 65).

use std::io::Write;
use std::time::Duration;

use clap::Args;
use reqwest::Method;
use serde_json::{json, Value};

use super::client::{CliError, Client};
use super::sandbox::segment;
use super::{render, ApiArgs};

/// How often a waiting pull looks at the template.
const POLL: Duration = Duration::from_millis(500);

/// The exit code of a pull that failed (`sysexits.h` `EX_DATAERR`: the image is unusable or
/// unreachable as named).
pub const PULL_FAILED: i32 = 65;

/// `berth template pull`
#[derive(Args, Debug)]
pub struct PullArgs {
    #[command(flatten)]
    api: ApiArgs,
    /// The template's name (1 to 64 of a-z, 0-9 and '-').
    name: String,
    /// The image: `registry/repo:tag` or `registry/repo@sha256:...`.
    image: String,
    /// The runtime of its sandboxes: `runsc` (gVisor: a stop keeps memory) or `runc`.
    #[arg(long)]
    runtime: Option<String>,
    /// One line for listings (default: the image).
    #[arg(long)]
    description: Option<String>,
    /// Return once the pull started (the template `pulling`) instead of waiting.
    #[arg(long)]
    no_wait: bool,
    /// How long to wait for the pull.
    #[arg(long, default_value = "30m")]
    timeout: humantime::Duration,
}

impl PullArgs {
    /// Where the API is and how to print.
    pub fn api(&self) -> &ApiArgs {
        &self.api
    }
}

fn print(text: &str) {
    let mut out = std::io::stdout().lock();
    let _ = out.write_all(text.as_bytes());
    let _ = out.flush();
}

/// `berth template pull`: see the module docs. Asking again for a template that is ready
/// answers at once (the API's POST is idempotent); one that failed is pulled again.
pub async fn pull(client: &Client, args: PullArgs) -> Result<i32, CliError> {
    let mut body = json!({ "name": args.name, "image": args.image });
    if let Some(runtime) = &args.runtime {
        body["runtime"] = json!(runtime);
    }
    if let Some(description) = &args.description {
        body["description"] = json!(description);
    }
    let mut template = client
        .json(Method::POST, "/v1/templates", Some(&body))
        .await?;
    let path = format!("/v1/templates/{}", segment(&args.name));
    let spinner = render::spinner(format!("pulling {}", args.image));
    let deadline = tokio::time::Instant::now() + Duration::from(args.timeout);
    while !args.no_wait && template["state"] == "pulling" {
        if tokio::time::Instant::now() >= deadline {
            spinner.finish_and_clear();
            return Err(CliError::Api {
                status: 408,
                code: "timeout".into(),
                message: format!(
                    "template {} is still pulling after {}; `berth template ls` shows it",
                    args.name, args.timeout
                ),
            });
        }
        tokio::time::sleep(POLL).await;
        template = client.json(Method::GET, &path, None).await?;
        if let Some(last) = template["events"].as_array().and_then(|e| e.last()) {
            spinner.set_message(format!(
                "pulling {}: {}",
                args.image,
                render::cell(&last["message"])
            ));
        }
    }
    spinner.finish_and_clear();
    if args.api.json {
        print(&render::json(&template));
    }
    if template["state"] == "failed" {
        eprintln!(
            "berth: template {} failed: {} ({})",
            args.name,
            render::cell(&template["error_message"]),
            render::cell(&template["error_code"])
        );
        return Ok(PULL_FAILED);
    }
    if !args.api.json {
        print(&summary(&template));
    }
    Ok(0)
}

/// One line for people: `NAME STATE DIGEST` (the digest once pulled).
fn summary(template: &Value) -> String {
    let mut line = format!(
        "{} {}",
        render::cell(&template["name"]),
        render::cell(&template["state"])
    );
    if let Some(digest) = template["image_digest"].as_str() {
        line.push(' ');
        line.push_str(digest);
    }
    line.push('\n');
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_summary_names_the_template_its_state_and_its_digest_once_pulled() {
        assert_eq!(
            summary(&json!({"name": "a", "state": "ready", "image_digest": "sha256:ab"})),
            "a ready sha256:ab\n"
        );
        assert_eq!(
            summary(&json!({"name": "a", "state": "pulling"})),
            "a pulling\n"
        );
    }
}
