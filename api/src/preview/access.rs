//! Who may reach a sandbox port through the proxy: a key of the owning org, a preview token
//! for that sandbox and port (or the cookie a preview link leaves), or anyone when the port is
//! public. Credentials meant for Berth are removed from the request before it is forwarded.
//!
//! A token travels in the [`TOKEN_HEADER`] header, the [`TOKEN_QUERY`] query parameter or the
//! [`TOKEN_COOKIE`] cookie; a key in `Authorization: Bearer berth_…`.
//!
//! # Guarantees
//! - Every `Authorization` and `Proxy-Authorization` value that carries a Berth key is removed,
//!   in any spelling (any scheme or spacing, a `Basic` pair that decodes to one), whether or not
//!   the key was used or valid; another value is the sandbox's business and passes. The token
//!   header, every token query parameter and every token cookie are removed too.
//! - A valid token from the query parameter of a `GET` or `HEAD` (not an upgrade) is answered
//!   with `303 See Other` to the same URL without the parameter, with `Set-Cookie` holding the
//!   token: `HttpOnly`, `SameSite=Lax`, `Path=/` on the preview host by host name (no
//!   `Domain`: that host only) or `Path=/v1/sandboxes/{id}/ports/{port}/` by path, `Max-Age` until
//!   the token expires, `Secure` when the preview scheme is `https`. This is how E2B's and
//!   Vercel's share links behave: the link's page loads its images, scripts and links with the
//!   cookie, and the token leaves the address bar (and `Referer`s).
//!
//! Precedence: a token in the header or query decides alone; else a key decides; else a valid
//! token cookie for this sandbox and port; else a public port; else `401`.

use std::net::IpAddr;

use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderValue, Method, Request, StatusCode, Uri};
use axum::response::Response;
use base64::Engine;
use berth_schemas::preview::{PreviewToken, VerifyError};

use super::page::{self, Page};
use super::routes::Route;
use super::{Preview, PreviewConfig, Target};
use crate::auth::KEY_PREFIX;
use crate::error::ApiError;

/// The header a preview token may travel in.
pub const TOKEN_HEADER: &str = "x-berth-preview-token";
/// The query parameter a preview token may travel in.
pub const TOKEN_QUERY: &str = "berth_preview_token";
/// The cookie a preview link leaves (the token itself).
pub const TOKEN_COOKIE: &str = "berth_preview_token";

/// What let a request through.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Grant {
    /// When the grant ends (Unix seconds): the token's expiry; `None` for a key or a public
    /// port.
    pub expires: Option<i64>,
    /// A token from the query parameter of a page load: answer with [`cookie_redirect`]
    /// instead of forwarding.
    pub set_cookie: Option<String>,
}

/// Checks the request's credentials against `route` and removes them from `req` and from
/// `target`'s query.
///
/// Errors: 401 without usable credentials for a private port, or with a bad, expired or
/// foreign token, or an unknown key; 404 for a key of another org (as for every other route);
/// 429 when the key's rate or the address's lookup budget is spent.
pub async fn authorize(
    preview: &Preview,
    req: &mut Request<Body>,
    route: &Route,
    target: &mut Target,
    peer: Option<IpAddr>,
) -> Result<Grant, Page> {
    let from_query = strip_query_token(&mut target.path_and_query);
    let from_header = req
        .headers_mut()
        .remove(TOKEN_HEADER)
        .and_then(|v| v.to_str().ok().map(str::to_owned));
    let from_cookie = strip_token_cookies(req.headers_mut());
    let key_principal = if !matches!(crate::auth::bearer_key(req.headers()), Ok(None)) {
        Some(crate::auth::principal_of(req.headers(), peer, &preview.db, &preview.guards).await)
    } else {
        None
    };
    strip_berth_keys(req.headers_mut());
    let verify = |token: &str| {
        let key = preview
            .config
            .token_key()
            .ok_or_else(|| Page::unauthorized("Previews are not configured."))?;
        match PreviewToken::verify(token, &key, chrono::Utc::now().timestamp()) {
            Ok(t) if t.sandbox == target.sandbox && t.port == target.port => Ok(t),
            Ok(_) => Err(Page::unauthorized(
                "This preview token is for another sandbox or port.",
            )),
            Err(VerifyError::Expired) => Err(Page::unauthorized("This preview link has expired.")),
            Err(_) => Err(Page::unauthorized("This preview token is not valid.")),
        }
    };
    if let Some(token) = from_header.as_deref().or(from_query.as_deref()) {
        let granted = verify(token)?;
        let page_load = from_header.is_none()
            && matches!(*req.method(), Method::GET | Method::HEAD)
            && !super::forward::is_upgrade(req);
        return Ok(Grant {
            expires: Some(granted.expires),
            set_cookie: page_load.then(|| token.to_owned()),
        });
    }
    match key_principal {
        Some(Ok(p)) if p.org_id == Some(route.org) => return Ok(Grant::default()),
        Some(Ok(_)) => return Err(Page::not_found(route.sandbox)),
        Some(Err(ApiError::Unauthorized)) => {
            return Err(Page::unauthorized("This API key is not valid."))
        }
        Some(Err(e)) => return Err(refusal(e)),
        None => {}
    }
    let mut refused = None;
    for token in &from_cookie {
        match verify(token) {
            Ok(granted) => {
                return Ok(Grant {
                    expires: Some(granted.expires),
                    set_cookie: None,
                })
            }
            Err(page) => refused = Some(page),
        }
    }
    if route.public_ports.contains(&target.port) {
        return Ok(Grant::default());
    }
    Err(refused.unwrap_or_else(|| {
        Page::unauthorized(
            "This preview is private: send an API key of its org, or open a preview link.",
        )
    }))
}

/// The answer to a preview link (a token in the query of a page load): `303` to `uri` without
/// the token, setting the token cookie for `target` until `expires` (Unix seconds).
pub fn cookie_redirect(
    config: &PreviewConfig,
    uri: &Uri,
    target: &Target,
    token: &str,
    expires: Option<i64>,
) -> Response {
    let mut location = uri
        .path_and_query()
        .map(|p| p.as_str().to_owned())
        .filter(|p| p.starts_with('/'))
        .unwrap_or_else(|| "/".to_owned());
    strip_query_token(&mut location);
    let path = if target.by_path {
        format!("/v1/sandboxes/{}/ports/{}/", target.sandbox, target.port)
    } else {
        "/".to_owned()
    };
    let max_age = expires
        .map(|at| at.saturating_sub(chrono::Utc::now().timestamp()).max(0))
        .unwrap_or(0);
    let secure = if config.scheme.eq_ignore_ascii_case("https") {
        "; Secure"
    } else {
        ""
    };
    let cookie = format!(
        "{TOKEN_COOKIE}={token}; Path={path}; Max-Age={max_age}; HttpOnly; SameSite=Lax{secure}"
    );
    let mut r = Response::new(Body::empty());
    *r.status_mut() = StatusCode::SEE_OTHER;
    let h = r.headers_mut();
    if let Ok(v) = HeaderValue::from_str(&location) {
        h.insert(header::LOCATION, v);
    }
    if let Ok(v) = HeaderValue::from_str(&cookie) {
        h.insert(header::SET_COOKIE, v);
    }
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    page::mark(r)
}

/// Removes every [`TOKEN_COOKIE`] from the `Cookie` headers (dropping a header left empty);
/// returns their values, in order.
fn strip_token_cookies(headers: &mut HeaderMap) -> Vec<String> {
    let mut tokens = Vec::new();
    let mut kept_headers = Vec::new();
    for value in headers.get_all(header::COOKIE) {
        let Ok(text) = value.to_str() else {
            kept_headers.push(value.clone());
            continue;
        };
        let mut kept = Vec::new();
        for pair in text.split(';').map(str::trim).filter(|p| !p.is_empty()) {
            match pair.split_once('=') {
                Some((name, v)) if name.trim() == TOKEN_COOKIE => {
                    tokens.push(v.trim().trim_matches('"').to_owned())
                }
                _ => kept.push(pair),
            }
        }
        if !kept.is_empty() {
            if let Ok(v) = HeaderValue::from_str(&kept.join("; ")) {
                kept_headers.push(v);
            }
        }
    }
    if tokens.is_empty() {
        return tokens;
    }
    headers.remove(header::COOKIE);
    for v in kept_headers {
        headers.append(header::COOKIE, v);
    }
    tokens
}

/// Whether an `Authorization`-like value carries a Berth key: the key's prefix at the start of
/// any of its words (any scheme, any separator), or inside a `Basic` pair.
fn carries_berth_key(value: &[u8]) -> bool {
    let text = String::from_utf8_lossy(value).to_ascii_lowercase();
    let prefix = KEY_PREFIX.to_ascii_lowercase();
    let starts_a_word = |text: &str| {
        text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '-'))
            .any(|word| word.starts_with(&prefix))
    };
    if starts_a_word(&text) {
        return true;
    }
    // `Basic base64(user:password)`, with either half a key.
    let original = String::from_utf8_lossy(value);
    original
        .split([' ', '\t', ','])
        .filter(|w| w.len() >= 8)
        .filter_map(|w| {
            let w = w.trim_matches(|c: char| c == '"' || c == '=');
            base64::engine::general_purpose::STANDARD_NO_PAD
                .decode(w)
                .or_else(|_| base64::engine::general_purpose::URL_SAFE_NO_PAD.decode(w))
                .ok()
        })
        .any(|decoded| starts_a_word(&String::from_utf8_lossy(&decoded).to_ascii_lowercase()))
}

/// Removes every `Authorization` and `Proxy-Authorization` value that carries a Berth key
/// ([`carries_berth_key`]), keeping the others in order.
fn strip_berth_keys(headers: &mut HeaderMap) {
    for name in [header::AUTHORIZATION, header::PROXY_AUTHORIZATION] {
        let values: Vec<HeaderValue> = headers.get_all(&name).iter().cloned().collect();
        if !values.iter().any(|v| carries_berth_key(v.as_bytes())) {
            continue;
        }
        headers.remove(&name);
        for v in values
            .into_iter()
            .filter(|v| !carries_berth_key(v.as_bytes()))
        {
            headers.append(&name, v);
        }
    }
}

/// A rate refusal (or a database failure), as a page with its status (and `Retry-After`).
pub(crate) fn refusal(e: ApiError) -> Page {
    let (status, _) = e.status_and_code();
    let mut page = Page::new(status, e.to_string());
    if let ApiError::RateLimited {
        retry_after_secs, ..
    } = e
    {
        page.retry_after = Some(retry_after_secs.max(1));
    } else if status == StatusCode::TOO_MANY_REQUESTS {
        page.retry_after = Some(1);
    }
    page
}

/// Removes every [`TOKEN_QUERY`] parameter from `path_and_query`; returns the first value.
fn strip_query_token(path_and_query: &mut String) -> Option<String> {
    let (path, query) = path_and_query.split_once('?')?;
    let mut token = None;
    let kept: Vec<&str> = query
        .split('&')
        .filter(|pair| {
            let name = pair.split_once('=').map_or(*pair, |(n, _)| n);
            if name == TOKEN_QUERY {
                if token.is_none() {
                    token = pair.split_once('=').map(|(_, v)| v.to_owned());
                }
                false
            } else {
                true
            }
        })
        .collect();
    let rebuilt = if kept.is_empty() {
        path.to_owned()
    } else {
        format!("{path}?{}", kept.join("&"))
    };
    *path_and_query = rebuilt;
    token
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_token_query_parameter_is_taken_out_and_the_rest_kept() {
        let mut p = "/a?x=1&berth_preview_token=abc&y=2".to_owned();
        assert_eq!(strip_query_token(&mut p).as_deref(), Some("abc"));
        assert_eq!(p, "/a?x=1&y=2");
        let mut only = "/?berth_preview_token=t".to_owned();
        assert_eq!(strip_query_token(&mut only).as_deref(), Some("t"));
        assert_eq!(only, "/");
        let mut none = "/b?q=berth_preview_token".to_owned();
        assert_eq!(strip_query_token(&mut none), None);
        assert_eq!(none, "/b?q=berth_preview_token");
    }

    #[test]
    fn every_spelling_of_a_berth_key_is_removed_and_other_credentials_pass() {
        let key = "berth_AbC-123_xyz";
        let basic_user = base64::engine::general_purpose::STANDARD.encode(format!("{key}:"));
        let basic_pw = base64::engine::general_purpose::STANDARD.encode(format!("me:{key}"));
        let mut h = HeaderMap::new();
        for v in [
            "Basic dXNlcjpwYXNzd29yZA==".to_owned(),
            format!("Bearer {key}"),
            format!("Bearer\t{key}"),
            format!("bearer   {key}"),
            format!("Token {key}"),
            key.to_owned(),
            "BERTH_ABC".to_owned(),
            format!("Basic {basic_user}"),
            format!("Basic {basic_pw}"),
            "Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig".to_owned(),
        ] {
            h.append(header::AUTHORIZATION, HeaderValue::from_str(&v).unwrap());
        }
        h.append(
            header::PROXY_AUTHORIZATION,
            HeaderValue::from_str(&format!("Bearer {key}")).unwrap(),
        );
        strip_berth_keys(&mut h);
        let left: Vec<_> = h
            .get_all(header::AUTHORIZATION)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect();
        assert_eq!(
            left,
            [
                "Basic dXNlcjpwYXNzd29yZA==",
                "Bearer eyJhbGciOiJIUzI1NiJ9.e30.sig"
            ]
        );
        assert!(h.get(header::PROXY_AUTHORIZATION).is_none());
    }

    #[test]
    fn token_cookies_are_taken_out_and_the_other_cookies_kept() {
        let mut h = HeaderMap::new();
        h.append(
            header::COOKIE,
            HeaderValue::from_static("a=1; berth_preview_token=t1; b=2"),
        );
        h.append(
            header::COOKIE,
            HeaderValue::from_static("berth_preview_token=t2"),
        );
        h.append(header::COOKIE, HeaderValue::from_static("c=3"));
        assert_eq!(strip_token_cookies(&mut h), ["t1", "t2"]);
        let left: Vec<_> = h
            .get_all(header::COOKIE)
            .iter()
            .map(|v| v.to_str().unwrap().to_owned())
            .collect();
        assert_eq!(left, ["a=1; b=2", "c=3"]);
        let mut none = HeaderMap::new();
        none.append(
            header::COOKIE,
            HeaderValue::from_static("x=berth_preview_token"),
        );
        assert!(strip_token_cookies(&mut none).is_empty());
        assert_eq!(none[header::COOKIE], "x=berth_preview_token");
    }
}
