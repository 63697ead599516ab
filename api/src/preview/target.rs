//! Which sandbox port a preview request is for: from its Host header
//! (`{port}-{sandbox_id}.{domain}`) or from its path (`/v1/sandboxes/{id}/ports/{port}/…`).

use axum::http::Uri;
use berth_schemas::SandboxId;

/// A sandbox port and the path to ask it for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// The sandbox.
    pub sandbox: SandboxId,
    /// The TCP port inside it (1 to 65535).
    pub port: u16,
    /// The path and query to forward (`/` at least).
    pub path_and_query: String,
    /// Whether the request named it by path (`/v1/sandboxes/{id}/ports/{port}/…`) rather than
    /// by host name: a preview link's cookie is then scoped to that path.
    pub by_path: bool,
}

/// The `{port}-{sandbox_id}` label of a host name under `domain` (case-insensitive; a `:port`
/// on either is ignored).
pub fn from_host(host: &str, domain: &str) -> Option<(SandboxId, u16)> {
    let host = strip_port(host).to_ascii_lowercase();
    let domain = strip_port(domain).to_ascii_lowercase();
    let label = host.strip_suffix(&domain)?.strip_suffix('.')?;
    let (port, id) = label.split_once('-')?;
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    Some((id.parse().ok()?, port))
}

fn strip_port(host: &str) -> &str {
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

/// A target from a Host-header match: the request's own path and query.
pub fn by_host(sandbox: SandboxId, port: u16, uri: &Uri) -> Target {
    Target {
        sandbox,
        port,
        path_and_query: uri
            .path_and_query()
            .map(|p| p.as_str().to_owned())
            .filter(|p| p.starts_with('/'))
            .unwrap_or_else(|| "/".to_owned()),
        by_path: false,
    }
}

/// A target from `/v1/sandboxes/{id}/ports/{port}/rest?query`: the sandbox's path is
/// `/rest?query`. `None` when the path is not of that shape.
pub fn from_path(uri: &Uri) -> Option<Target> {
    let rest = uri.path().strip_prefix("/v1/sandboxes/")?;
    let (id, rest) = rest.split_once('/')?;
    let rest = rest.strip_prefix("ports/")?;
    let (port, rest) = match rest.split_once('/') {
        Some((port, rest)) => (port, rest),
        None => (rest, ""),
    };
    let port: u16 = port.parse().ok().filter(|p| *p != 0)?;
    let sandbox = id.parse().ok()?;
    let mut path_and_query = format!("/{rest}");
    if let Some(q) = uri.query() {
        path_and_query.push('?');
        path_and_query.push_str(q);
    }
    Some(Target {
        sandbox,
        port,
        path_and_query,
        by_path: true,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_host_name_names_a_port_and_a_sandbox_under_the_domain_only() {
        let id = SandboxId::new();
        let d = "preview.example.com";
        assert_eq!(from_host(&format!("8080-{id}.{d}"), d), Some((id, 8080)));
        assert_eq!(
            from_host(
                &format!("8080-{id}.PREVIEW.example.com:443"),
                "preview.example.com:8090"
            ),
            Some((id, 8080))
        );
        assert_eq!(from_host(&format!("8080-{id}.evil.com"), d), None);
        assert_eq!(from_host(&format!("8080-{id}x.{d}"), d), None);
        assert_eq!(from_host(&format!("0-{id}.{d}"), d), None);
        assert_eq!(from_host(&format!("99999-{id}.{d}"), d), None);
        assert_eq!(from_host(d, d), None);
    }

    #[test]
    fn a_path_names_a_port_and_the_rest_is_the_sandboxs_path() {
        let id = SandboxId::new();
        let uri: Uri = format!("/v1/sandboxes/{id}/ports/8000/a/b?x=1")
            .parse()
            .unwrap();
        assert_eq!(
            from_path(&uri),
            Some(Target {
                sandbox: id,
                port: 8000,
                path_and_query: "/a/b?x=1".into(),
                by_path: true,
            })
        );
        let bare: Uri = format!("/v1/sandboxes/{id}/ports/8000").parse().unwrap();
        assert_eq!(from_path(&bare).unwrap().path_and_query, "/");
        let bad: Uri = format!("/v1/sandboxes/{id}/files").parse().unwrap();
        assert_eq!(from_path(&bad), None);
        let zero: Uri = format!("/v1/sandboxes/{id}/ports/0/").parse().unwrap();
        assert_eq!(from_path(&zero), None);
    }
}
