//! Who may reach a sandbox port through the proxy: a key of the owning org, a preview token
//! for that sandbox and port, or anyone when the port is public. Credentials meant for Berth
//! are removed from the request before it is forwarded.
//!
//! A token travels in the [`TOKEN_HEADER`] header or the [`TOKEN_QUERY`] query parameter; a
//! key in `Authorization: Bearer bk_…` (an `Authorization` header that is not a Berth key is
//! the sandbox's business and is forwarded untouched).

use std::net::IpAddr;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use berth_schemas::preview::{PreviewToken, VerifyError};

use super::page::Page;
use super::routes::Route;
use super::{Preview, Target};
use crate::error::ApiError;

/// The header a preview token may travel in.
pub const TOKEN_HEADER: &str = "x-berth-preview-token";
/// The query parameter a preview token may travel in.
pub const TOKEN_QUERY: &str = "berth_preview_token";

/// Checks the request's credentials against `route` and removes them from `req` and from
/// `target`'s query.
///
/// Errors: 401 without usable credentials for a private port, or with a bad, expired or
/// foreign token, or an unknown key; 404 for a key of another org (as for every other route).
pub async fn authorize(
    preview: &Preview,
    req: &mut Request<Body>,
    route: &Route,
    target: &mut Target,
    peer: Option<IpAddr>,
) -> Result<(), Page> {
    let from_query = strip_query_token(&mut target.path_and_query);
    let from_header = req
        .headers_mut()
        .remove(TOKEN_HEADER)
        .and_then(|v| v.to_str().ok().map(str::to_owned));
    let key_principal = if crate::auth::bearer_key(req.headers()).is_some() {
        let found =
            crate::auth::principal_of(req.headers(), peer, &preview.db, &preview.guards).await;
        req.headers_mut().remove(header::AUTHORIZATION);
        Some(found)
    } else {
        None
    };
    if let Some(token) = from_header.or(from_query) {
        let key = preview
            .config
            .token_key()
            .ok_or_else(|| Page::unauthorized("Previews are not configured."))?;
        let now = chrono::Utc::now().timestamp();
        return match PreviewToken::verify(&token, &key, now) {
            Ok(t) if t.sandbox == target.sandbox && t.port == target.port => Ok(()),
            Ok(_) => Err(Page::unauthorized(
                "This preview token is for another sandbox or port.",
            )),
            Err(VerifyError::Expired) => Err(Page::unauthorized("This preview link has expired.")),
            Err(_) => Err(Page::unauthorized("This preview token is not valid.")),
        };
    }
    match key_principal {
        Some(Ok(p)) if p.org_id == Some(route.org) => Ok(()),
        Some(Ok(_)) => Err(Page::not_found(route.sandbox)),
        Some(Err(ApiError::Unauthorized)) => Err(Page::unauthorized("This API key is not valid.")),
        Some(Err(e)) => Err(refusal(e)),
        None if route.public_ports.contains(&target.port) => Ok(()),
        None => Err(Page::unauthorized(
            "This preview is private: send an API key of its org, or open a preview link.",
        )),
    }
}

/// A rate refusal (or a database failure) of the key lookup, as a page with its status.
fn refusal(e: ApiError) -> Page {
    let (status, _) = e.status_and_code();
    let mut page = Page::new(status, e.to_string());
    if status == StatusCode::TOO_MANY_REQUESTS {
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
}
