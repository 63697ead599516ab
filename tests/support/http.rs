//! What a test does with a running [`Stack`]: authenticated HTTP calls, the sandbox
//! lifecycle through the API, and looking on the machine for what a sandbox left.

use std::time::Duration;

use serde_json::{json, Value};
use uuid::Uuid;

use super::env::SETTLE_TIMEOUT;
use super::stack::Stack;

impl Stack {
    /// An authenticated request with this stack's key.
    pub async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        self.call_as(&self.key, method, path, body).await
    }

    /// An authenticated request with `key`.
    pub async fn call_as(
        &self,
        key: &str,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> (u16, Value) {
        let mut req = self.http.request(method, self.url(path)).bearer_auth(key);
        if let Some(body) = body {
            req = req.json(&body);
        }
        let resp = req.send().await.unwrap();
        let status = resp.status().as_u16();
        let text = resp.text().await.unwrap();
        let value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        (status, value)
    }

    /// Creates a sandbox of the base template and returns its id.
    pub async fn create(&self) -> String {
        let (status, body) = self
            .call(
                reqwest::Method::POST,
                "/v1/sandboxes",
                Some(json!({"template": "base", "vcpus": 1, "memory_mib": 256})),
            )
            .await;
        assert_eq!(status, 202, "{body}");
        body["id"].as_str().unwrap().to_owned()
    }

    /// Polls until the sandbox is in `state`; panics with its last view after the timeout.
    pub async fn wait_state(&self, id: &str, state: &str) -> Value {
        let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
        loop {
            let (status, body) = self
                .call(reqwest::Method::GET, &format!("/v1/sandboxes/{id}"), None)
                .await;
            assert_eq!(status, 200, "{body}");
            if body["state"] == state {
                return body;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "sandbox {id} never reached {state}; last seen {body}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Runs `cmd` in the sandbox and returns the response body.
    pub async fn exec(&self, id: &str, cmd: &[&str]) -> (u16, Value) {
        self.call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/exec"),
            Some(json!({ "cmd": cmd, "timeout_ms": 10_000 })),
        )
        .await
    }

    /// The state of a sandbox, read from its row.
    pub async fn state_of(&self, id: &str) -> String {
        sqlx::query_scalar("SELECT state FROM sandboxes WHERE id = $1::uuid")
            .bind(id)
            .fetch_one(&self.db)
            .await
            .unwrap()
    }

    /// Sends a lifecycle request (`stop`, `start`, `pause`, `resume`) and returns the status.
    pub async fn request(&self, id: &str, what: &str) -> (u16, Value) {
        self.call(
            reqwest::Method::POST,
            &format!("/v1/sandboxes/{id}/{what}"),
            None,
        )
        .await
    }

    /// Deletes a sandbox and returns the status.
    pub async fn delete(&self, id: &str) -> (u16, Value) {
        self.call(
            reqwest::Method::DELETE,
            &format!("/v1/sandboxes/{id}"),
            None,
        )
        .await
    }

    /// Whether any host still runs a container of `id` (by `runc list`).
    pub fn container_exists(&self, id: &str) -> bool {
        self.hosts.iter().any(|h| {
            let out = std::process::Command::new("runc")
                .arg("--root")
                .arg(h.runc_root())
                .args(["list", "-q"])
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).contains(&id.replace('-', "")[..12])
                || String::from_utf8_lossy(&out.stdout).contains(id)
        })
    }

    /// Waits until nothing of the sandbox is left on any host ([`Stack::leftovers`]), at
    /// most [`SETTLE_TIMEOUT`]: a delete answers before the kernel removed the veth pair
    /// with its namespace.
    pub async fn nothing_left(&self, id: &str) {
        let deadline = tokio::time::Instant::now() + SETTLE_TIMEOUT;
        loop {
            let left = self.leftovers(id);
            if left.is_empty() {
                return;
            }
            assert!(tokio::time::Instant::now() < deadline, "{id} left {left:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// What any host left of a sandbox: its container, netns, host veth, mounts, loop devices
    /// and directory, looked up by the names hostd derives for it.
    pub fn leftovers(&self, id: &str) -> Vec<String> {
        let sandbox: berth_schemas::SandboxId = id.parse().unwrap();
        let netns = std::process::Command::new("ip")
            .args(["netns", "list"])
            .output()
            .unwrap();
        let netns = String::from_utf8_lossy(&netns.stdout).into_owned();
        let links = std::process::Command::new("ip")
            .args(["-o", "link"])
            .output()
            .unwrap();
        let links = String::from_utf8_lossy(&links.stdout).into_owned();
        let mounts = std::fs::read_to_string("/proc/mounts").unwrap();
        let mut found = Vec::new();
        if self.container_exists(id) {
            found.push("a runc container".to_owned());
        }
        for host in &self.hosts {
            let names = berth_hostd::layout::SandboxNames::derive(host.host_id, sandbox);
            if netns
                .lines()
                .any(|l| l.split_whitespace().next() == Some(names.netns.as_str()))
            {
                found.push(format!("netns {}", names.netns));
            }
            if links.contains(&format!(" {}@", names.veth_host))
                || links.contains(&format!(" {}:", names.veth_host))
            {
                found.push(format!("veth {}", names.veth_host));
            }
            let dir = host.state_dir.join("sandboxes").join(id);
            if dir.exists() {
                found.push(format!("dir {}", dir.display()));
            }
        }
        found.extend(
            mounts
                .lines()
                .filter(|l| l.contains(id))
                .map(|l| format!("mount {l}")),
        );
        if let Ok(devices) = std::fs::read_dir("/sys/block") {
            for device in devices.flatten() {
                let backing = device.path().join("loop/backing_file");
                if std::fs::read_to_string(backing).is_ok_and(|b| b.contains(id)) {
                    found.push(format!(
                        "loop device {}",
                        device.file_name().to_string_lossy()
                    ));
                }
            }
        }
        found
    }

    /// Guarantee 4: every host's reservation equals what its capacity-holding sandboxes need.
    pub async fn assert_no_capacity_drift(&self) {
        let drift = berth_reconciler::pass::capacity_drift(&self.db)
            .await
            .unwrap();
        assert_eq!(drift, (0, 0), "capacity drift (vcpus, memory_mib)");
    }
}

/// Creates a gVisor (runsc) sandbox of the `base-gvisor` template and waits until it runs.
pub async fn running_gvisor_sandbox(stack: &Stack) -> String {
    let (status, body) = stack
        .call(
            reqwest::Method::POST,
            "/v1/sandboxes",
            Some(json!({"template": "base-gvisor", "vcpus": 1, "memory_mib": 256})),
        )
        .await;
    assert_eq!(status, 202, "{body}");
    let id = body["id"].as_str().unwrap().to_owned();
    stack.wait_state(&id, "running").await;
    id
}

/// Creates a sandbox and waits until it runs.
pub async fn running_sandbox(stack: &Stack) -> String {
    let id = stack.create().await;
    stack.wait_state(&id, "running").await;
    id
}

/// Creates a sandbox, waits until it runs, stops it and waits until it is stopped.
pub async fn stopped_sandbox(stack: &Stack) -> String {
    let id = running_sandbox(stack).await;
    assert_eq!(stack.request(&id, "stop").await.0, 202);
    stack.wait_state(&id, "stopped").await;
    id
}

/// The host a sandbox's row names.
pub async fn host_of(stack: &Stack, id: &str) -> Uuid {
    sqlx::query_scalar("SELECT host_id FROM sandboxes WHERE id = $1::uuid")
        .bind(id)
        .fetch_one(&stack.db)
        .await
        .unwrap()
}
