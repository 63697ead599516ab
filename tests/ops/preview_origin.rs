//! What a sandbox's answers may do beyond its own preview (an attack run's findings): its
//! cookies stay on its own preview host (or, by path, under its own port's prefix), it cannot
//! plant the share link's cookie, its pages served by path run as an opaque origin, and a
//! stream it keeps writing ends when the preview token that opened it expires. Servers are
//! busybox `nc` scripts in a runc sandbox.

use std::time::Duration;

use berth_api::preview::confine::PATH_ROUTE_CSP;
use berth_schemas::preview::{self, PreviewToken};
use reqwest::header::{AUTHORIZATION, CONTENT_SECURITY_POLICY, HOST, SET_COOKIE};
use serde_json::json;
use sqlx::PgPool;

use crate::preview_kit::{create_running, preview_host, sh, wait_listening};
use crate::support::stack::PREVIEW_SECRET;
use crate::support::Stack;

/// The longest a test waits for a stream to be cut after its token's expiry.
const CUT_BOUND: Duration = Duration::from_secs(40);

/// `cookies.sh` answers a page setting cookies for the whole preview domain, the share link's
/// cookie (plain and `__Host-`), and one of its own; `ticks.sh` answers an event stream that
/// writes `data: tick` every second until its client goes away.
const SERVERS: &str = r#"mkdir -p /srv
cat > /srv/cookies.sh <<'EOF'
#!/bin/sh
while IFS= read -r line; do
  case "$line" in ''|$(printf '\r')) break ;; esac
done
printf 'HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nSet-Cookie: wide=1; Domain=preview.test; Path=/\r\nSet-Cookie: berth_preview_token=forged; Path=/\r\nSet-Cookie: __Host-berth_preview_token=forged; Path=/; Secure\r\nSet-Cookie: own=2; Path=/; HttpOnly\r\nContent-Security-Policy: default-src *\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi'
EOF
cat > /srv/ticks.sh <<'EOF'
#!/bin/sh
while IFS= read -r line; do
  case "$line" in ''|$(printf '\r')) break ;; esac
done
printf 'HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n'
while printf 'data: tick\n\n'; do sleep 1; done
EOF
chmod +x /srv/cookies.sh /srv/ticks.sh"#;

/// A runc sandbox with [`SERVERS`] running: `script` on each of `ports`; its id.
async fn sandbox_serving(stack: &Stack, script: &str, ports: &[u16]) -> String {
    let id = create_running(
        stack,
        json!({"template": "base", "vcpus": 1, "memory_mib": 256}),
    )
    .await;
    sh(stack, &id, SERVERS).await;
    for port in ports {
        sh(
            stack,
            &id,
            &format!("busybox nc -ll -p {port} -e /srv/{script} </dev/null >/dev/null 2>&1 &"),
        )
        .await;
    }
    for port in ports {
        wait_listening(stack, &id, *port).await;
    }
    id
}

/// Every value of header `name`.
fn all(headers: &reqwest::header::HeaderMap, name: reqwest::header::HeaderName) -> Vec<String> {
    headers
        .get_all(name)
        .iter()
        .map(|v| v.to_str().unwrap().to_owned())
        .collect()
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_sandbox_cannot_set_cookies_beyond_its_preview_and_its_pages_by_path_run_sandboxed(
    db: PgPool,
) {
    let stack = Stack::start(db, 1).await;
    let id = sandbox_serving(&stack, "cookies.sh", &[8007]).await;
    let prefix = format!("/v1/sandboxes/{id}/ports/8007/");

    // By host name: host-only cookies (no Domain), no share link cookie, its own policy only.
    let resp = stack
        .http
        .get(format!("http://{}/", stack.proxy_addr))
        .header(HOST, preview_host(&id, 8007))
        .header(AUTHORIZATION, format!("Bearer {}", stack.key))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(
        all(resp.headers(), SET_COOKIE),
        ["wide=1; Path=/", "own=2; Path=/; HttpOnly"]
    );
    assert_eq!(
        all(resp.headers(), CONTENT_SECURITY_POLICY),
        ["default-src *"]
    );

    // By path, on the API and on the proxy: cookies under the port's prefix, and the page runs
    // as an opaque origin on top of its own policy.
    for base in [stack.url(""), format!("http://{}", stack.proxy_addr)] {
        let resp = stack
            .http
            .get(format!("{base}{prefix}"))
            .header(AUTHORIZATION, format!("Bearer {}", stack.key))
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{base}");
        assert_eq!(
            all(resp.headers(), SET_COOKIE),
            [
                format!("wide=1; Path={prefix}"),
                format!("own=2; Path={prefix}; HttpOnly")
            ],
            "{base}"
        );
        assert_eq!(
            all(resp.headers(), CONTENT_SECURITY_POLICY),
            ["default-src *", PATH_ROUTE_CSP],
            "{base}"
        );
        assert_eq!(resp.headers()["x-content-type-options"], "nosniff");
        assert_eq!(resp.text().await.unwrap(), "hi");
    }

    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}

/// Reads `resp`'s body until it ends or fails; how many `tick` events came and whether it ended
/// within [`CUT_BOUND`].
async fn ticks_until_cut(mut resp: reqwest::Response) -> (usize, bool) {
    let mut ticks = 0;
    let ended = tokio::time::timeout(CUT_BOUND, async {
        while let Ok(Some(chunk)) = resp.chunk().await {
            ticks += String::from_utf8_lossy(&chunk).matches("tick").count();
        }
    })
    .await
    .is_ok();
    (ticks, ended)
}

#[sqlx::test(migrator = "berth_store::MIGRATOR")]
async fn a_stream_opened_with_a_preview_token_ends_when_the_token_expires(db: PgPool) {
    let stack = Stack::start(db, 1).await;
    let id = sandbox_serving(&stack, "ticks.sh", &[8011, 8012]).await;
    let expires = chrono::Utc::now().timestamp() + 8;
    let token = PreviewToken {
        sandbox: id.parse().unwrap(),
        port: 8011,
        expires,
    }
    .sign(&preview::token_key(PREVIEW_SECRET));
    let by_token = stack
        .http
        .get(format!("http://{}/", stack.proxy_addr))
        .header(HOST, preview_host(&id, 8011))
        .header("x-berth-preview-token", token)
        .send()
        .await
        .unwrap();
    assert_eq!(by_token.status(), 200);
    let mut by_key = stack
        .http
        .get(format!("http://{}/", stack.proxy_addr))
        .header(HOST, preview_host(&id, 8012))
        .header(AUTHORIZATION, format!("Bearer {}", stack.key))
        .send()
        .await
        .unwrap();
    assert_eq!(by_key.status(), 200);

    let (ticks, ended) = ticks_until_cut(by_token).await;
    assert!(ended, "a stream outlived its token by {CUT_BOUND:?}");
    assert!(
        chrono::Utc::now().timestamp() >= expires,
        "cut before the token expired"
    );
    assert!(
        ticks >= 2,
        "the stream flowed before its cut: {ticks} ticks"
    );
    // A stream opened with a key has no grant to outlive: it still flows.
    let more = tokio::time::timeout(CUT_BOUND, by_key.chunk())
        .await
        .expect("the key's stream stalled")
        .expect("the key's stream was cut");
    assert!(more.is_some(), "the key's stream ended");

    drop(by_key);
    stack.delete(&id).await;
    stack.wait_state(&id, "deleted").await;
    stack.teardown().await;
}
