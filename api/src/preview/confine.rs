//! What a sandbox's response may do to the browser of whoever opens its preview: keep its
//! cookies to its own preview, and, on a shared origin (the path route), run as an opaque
//! origin.
//!
//! Every sandbox's host-name preview is a sibling under one preview domain
//! (`{port}-{id}.{domain}`), and the path route (`/v1/sandboxes/{id}/ports/{port}/…`) serves
//! every tenant's pages on the API's own origin (or the proxy's). Left alone, a sandbox could
//! `Set-Cookie; Domain={domain}` and reach every other tenant's previews, overwrite the share
//! link cookie others rely on, or, by path, run script on the API's origin.
//!
//! # Guarantees
//! - Every `Set-Cookie` of a forwarded response loses its `Domain` attribute, so the cookie is
//!   host-only: by host name it belongs to `{port}-{id}.{domain}` alone, never to the preview
//!   domain or a sibling.
//! - By path, every `Set-Cookie` is scoped to the sandbox port's own prefix
//!   (`Path=/v1/sandboxes/{id}/ports/{port}/`, or a path under it the sandbox named), so it is
//!   never sent to the API's routes or another sandbox's.
//! - A `Set-Cookie` whose name is the share link's ([`super::access::TOKEN_COOKIE`], also
//!   behind a `__Host-`/`__Secure-` prefix, any case) or that is not readable text is dropped:
//!   a sandbox cannot plant or shadow a preview grant.
//! - By path, the response carries [`PATH_ROUTE_CSP`] (`Content-Security-Policy: sandbox …`
//!   without `allow-same-origin`) in addition to any policy of its own: a page served on the
//!   API's origin runs as an opaque origin, so its scripts can read nothing of that origin
//!   (cookies, storage, same-origin responses). Pages still load, run scripts and submit
//!   forms. `X-Content-Type-Options: nosniff` keeps a non-HTML answer from being sniffed into
//!   a page.
//!
//! Not covered (see README "Security model"): a script on a host-name preview can still set a
//! cookie for the preview domain through `document.cookie`; only listing the preview domain
//! in the Public Suffix List (or a domain per tenant) stops a browser from accepting it.

use axum::http::{header, HeaderMap, HeaderValue};

use super::access::TOKEN_COOKIE;
use super::Target;

/// The policy every path-route response carries: a sandboxed document (scripts, forms,
/// popups, modals and downloads allowed) in an opaque origin (no `allow-same-origin`).
pub const PATH_ROUTE_CSP: &str =
    "sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads";

/// Applies the module's guarantees to the headers of a response forwarded for `target`.
pub fn response_headers(headers: &mut HeaderMap, target: &Target) {
    let prefix = format!("/v1/sandboxes/{}/ports/{}/", target.sandbox, target.port);
    let scope = target.by_path.then_some(prefix.as_str());
    let cookies: Vec<HeaderValue> = headers
        .get_all(header::SET_COOKIE)
        .iter()
        .cloned()
        .collect();
    if !cookies.is_empty() {
        headers.remove(header::SET_COOKIE);
        for value in cookies {
            let confined = value.to_str().ok().and_then(|c| confine_cookie(c, scope));
            if let Some(v) = confined.and_then(|c| HeaderValue::from_str(&c).ok()) {
                headers.append(header::SET_COOKIE, v);
            } else {
                metrics::counter!("berth_preview_cookies_dropped_total").increment(1);
            }
        }
    }
    if target.by_path {
        headers.append(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(PATH_ROUTE_CSP),
        );
        headers.insert(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        );
    }
}

/// One `Set-Cookie` value made host-only (no `Domain`) and, with `scope` (the path route's
/// prefix), confined to that prefix; `None` drops it (the share link's name, no name).
pub fn confine_cookie(value: &str, scope: Option<&str>) -> Option<String> {
    let mut parts = value.split(';');
    let pair = parts.next()?.trim();
    let name = pair.split_once('=').map_or(pair, |(n, _)| n).trim();
    if name.is_empty() || is_grant_name(name) {
        return None;
    }
    let mut kept = vec![pair.to_owned()];
    let mut path_set = false;
    for attr in parts.map(str::trim).filter(|a| !a.is_empty()) {
        let (key, val) = attr.split_once('=').unwrap_or((attr, ""));
        let key = key.trim();
        if key.eq_ignore_ascii_case("domain") {
            continue;
        }
        if key.eq_ignore_ascii_case("path") {
            if let Some(prefix) = scope {
                let val = val.trim();
                let inside = val.starts_with(prefix) && !val.contains("..");
                kept.push(format!("Path={}", if inside { val } else { prefix }));
                path_set = true;
                continue;
            }
        }
        kept.push(attr.to_owned());
    }
    if let (Some(prefix), false) = (scope, path_set) {
        kept.push(format!("Path={prefix}"));
    }
    Some(kept.join("; "))
}

/// Whether a cookie name is the share link's, also behind a cookie prefix and in any case
/// (browsers compare names exactly; Berth reads its own case-sensitively, but refuses all).
fn is_grant_name(name: &str) -> bool {
    let lower = name.to_ascii_lowercase();
    let bare = lower
        .strip_prefix("__host-")
        .or_else(|| lower.strip_prefix("__secure-"))
        .unwrap_or(&lower);
    bare == TOKEN_COOKIE
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCOPE: &str = "/v1/sandboxes/0b3e/ports/80/";

    #[test]
    fn a_cookie_loses_its_domain_in_any_spelling() {
        assert_eq!(
            confine_cookie("a=1; Domain=preview.localhost; Path=/; HttpOnly", None).as_deref(),
            Some("a=1; Path=/; HttpOnly")
        );
        assert_eq!(
            confine_cookie("a=1;domain=.preview.localhost;secure", None).as_deref(),
            Some("a=1; secure")
        );
        assert_eq!(
            confine_cookie("a=1; DOMAIN = x", None).as_deref(),
            Some("a=1")
        );
    }

    #[test]
    fn by_path_a_cookie_stays_under_the_ports_prefix() {
        assert_eq!(
            confine_cookie("a=1; Path=/", Some(SCOPE)).as_deref(),
            Some("a=1; Path=/v1/sandboxes/0b3e/ports/80/")
        );
        assert_eq!(
            confine_cookie("a=1", Some(SCOPE)).as_deref(),
            Some("a=1; Path=/v1/sandboxes/0b3e/ports/80/")
        );
        assert_eq!(
            confine_cookie("a=1; Path=/v1/sandboxes/0b3e/ports/80/app", Some(SCOPE)).as_deref(),
            Some("a=1; Path=/v1/sandboxes/0b3e/ports/80/app")
        );
        assert_eq!(
            confine_cookie(
                "a=1; Path=/v1/sandboxes/0b3e/ports/80/../../other/ports/80/",
                Some(SCOPE)
            )
            .as_deref(),
            Some("a=1; Path=/v1/sandboxes/0b3e/ports/80/")
        );
        assert_eq!(
            confine_cookie("a=1; Path=/v1/sandboxes/ffff/ports/80/", Some(SCOPE)).as_deref(),
            Some("a=1; Path=/v1/sandboxes/0b3e/ports/80/")
        );
    }

    #[test]
    fn the_share_link_cookie_and_nameless_cookies_are_dropped() {
        for value in [
            "berth_preview_token=v1.x; Path=/",
            "BERTH_PREVIEW_TOKEN=v1.x",
            "__Host-berth_preview_token=v1.x; Path=/; Secure",
            "__Secure-berth_preview_token=v1.x",
            " berth_preview_token =v1.x",
            "=v1.x",
            "",
        ] {
            assert_eq!(confine_cookie(value, None), None, "{value}");
            assert_eq!(confine_cookie(value, Some(SCOPE)), None, "{value}");
        }
        assert!(confine_cookie("berth_preview_token_x=1", None).is_some());
    }

    #[test]
    fn a_path_route_response_gets_the_sandbox_policy_and_a_host_route_response_does_not() {
        let target = |by_path| Target {
            sandbox: "0b3e5c64-3b4e-4a3c-9a51-2b0f0e7d7a11".parse().unwrap(),
            port: 80,
            path_and_query: "/".into(),
            by_path,
        };
        let mut headers = HeaderMap::new();
        headers.append(
            header::SET_COOKIE,
            HeaderValue::from_static("a=1; Domain=x"),
        );
        headers.append(
            header::SET_COOKIE,
            HeaderValue::from_static("berth_preview_token=forged"),
        );
        headers.append(
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static("default-src 'self'"),
        );
        let mut by_host = headers.clone();
        response_headers(&mut by_host, &target(false));
        let cookies: Vec<_> = by_host.get_all(header::SET_COOKIE).iter().collect();
        assert_eq!(cookies, ["a=1"]);
        assert_eq!(
            by_host
                .get_all(header::CONTENT_SECURITY_POLICY)
                .iter()
                .count(),
            1
        );
        let mut by_path = headers;
        response_headers(&mut by_path, &target(true));
        let cookies: Vec<_> = by_path.get_all(header::SET_COOKIE).iter().collect();
        assert_eq!(
            cookies,
            ["a=1; Path=/v1/sandboxes/0b3e5c64-3b4e-4a3c-9a51-2b0f0e7d7a11/ports/80/"]
        );
        let policies: Vec<_> = by_path
            .get_all(header::CONTENT_SECURITY_POLICY)
            .iter()
            .collect();
        assert_eq!(policies, ["default-src 'self'", PATH_ROUTE_CSP]);
        assert_eq!(by_path[header::X_CONTENT_TYPE_OPTIONS], "nosniff");
    }
}
