//! The OpenAPI 3.1 document served at `/openapi.json`, generated with utoipa from the route
//! annotations; its description carries the request × state table of
//! [`berth_schemas::state`].

use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use crate::http::{events, exec, files, hosts, sandboxes, settings, templates};
use crate::model;

/// The API description, with the lifecycle table.
const DESCRIPTION: &str = r#"Berth: create isolated Linux sandboxes, run code in them, stop, start and delete them.

Authenticate with `Authorization: Bearer <api key>`. Errors are `{"error":{"code":"…","message":"…"}}`.

## Lifecycle requests × states

`=` returns the sandbox unchanged (200); `409` is `conflict` with the current `state`; otherwise
the request is accepted (202) and the sandbox moves to the state shown. A sandbox being deleted
answers `=` to delete and `409` to everything else. `pause` is an alias of `stop`, `resume` of
`start`.

| state          | start / resume | stop / pause | delete   |
|----------------|----------------|--------------|----------|
| provisioning   | =              | 409          | stopping |
| starting       | =              | 409          | stopping |
| running        | =              | stopping     | stopping |
| stopping       | 409            | =            | stopping |
| stopped        | starting, or migrating (its host gone, lost, silent, draining, cordoned or full, and its stop durable) | = | stopping |
| resuming       | =              | 409          | stopping |
| restoring      | =              | 409          | stopping |
| migrating      | =              | 409          | stopping |
| archiving      | 409            | =            | stopping |
| archived       | unarchiving    | =            | deleted  |
| unarchiving    | =              | 409          | stopping |
| failed-start   | starting       | =            | stopping |
| failed-start (S) | resuming     | =            | stopping |
| deleted        | 409            | 409          | =        |

`(S)`: a clone (or fork child, or `POST /v1/sandboxes {snapshot_id}`) whose boot failed before
it ever ran has no disk of its own; its start boots from its snapshot again (`resuming`), or is
409 `snapshot_unavailable` once that snapshot is no longer `ready`.

`PATCH /v1/sandboxes/{id}` and `POST …/renew` are accepted in every state but a sandbox being
deleted or deleted (409); they change settings, not the state, and emit `sandbox.updated`.

## Waiting

`GET /v1/sandboxes/{id}/wait?state=running|stopped|deleted&timeout=30s`, or `?wait=…&timeout=…`
on a create or lifecycle request, answers 200 with the sandbox as soon as it is in that state
(woken by the database's notification of the change, not by polling); 409 with `state` and
`sandbox_id` when it settled where it cannot get there without a new request (a settled state
— `running`, `stopped`, `failed-start` — other than the target, or being deleted); 408
`timeout` with `state` and `sandbox_id` when `timeout` (default 30 s, at most 5 minutes)
passes first.
"#;

#[derive(OpenApi)]
#[openapi(
    info(title = "Berth API", version = "1"),
    paths(
        sandboxes::create,
        sandboxes::list,
        sandboxes::get,
        sandboxes::delete,
        sandboxes::stop,
        sandboxes::pause,
        sandboxes::archive,
        sandboxes::start,
        sandboxes::resume,
        settings::patch,
        settings::renew,
        settings::wait_for,
        events::events,
        templates::templates,
        templates::get,
        templates::delete,
        templates::create,
        exec::exec,
        hosts::list,
        hosts::get,
        hosts::drain,
        hosts::cordon,
        hosts::uncordon,
        crate::http::preview::token,
        crate::http::snapshots::create,
        crate::http::snapshots::backup,
        crate::http::snapshots::list,
        crate::http::snapshots::get,
        crate::http::snapshots::delete,
        crate::http::resume::restore,
        crate::http::resume::restore_from_backup,
        crate::http::resume::clone,
        crate::http::resume::fork,
        crate::http::keys::list,
        crate::http::keys::create,
        crate::http::keys::revoke,
    ),
    components(schemas(
        model::snapshot::Snapshot,
        model::snapshot::SnapshotList,
        model::snapshot::FromSnapshot,
        model::snapshot::FromBackup,
        model::snapshot::ForkRequest,
        model::snapshot::Fork,
        crate::http::keys::ApiKey,
        crate::http::keys::CreatedKey,
        crate::http::keys::KeyList,
        berth_schemas::state::snapshot::SnapshotState,
        crate::http::preview::TokenRequest,
        crate::http::preview::PreviewTokenResponse,
        model::CreateSandbox,
        model::settings::PatchSandbox,
        model::settings::RenewSandbox,
        model::Sandbox,
        model::SandboxList,
        model::ExecBody,
        model::ExecOutput,
        model::Event,
        model::Template,
        model::TemplateEvent,
        model::CreateTemplate,
        crate::service::hosts::Host,
        crate::service::hosts::HostHealth,
        crate::service::hosts::HostOvercommit,
        crate::service::hosts::Drain,
        crate::service::hosts::DrainFailure,
        crate::http::hosts::DrainBody,
        berth_schemas::SandboxState,
    )),
    modifiers(&BearerAuth)
)]
struct ApiDoc;

/// The event stream and webhook routes.
#[derive(OpenApi)]
#[openapi(
    paths(
        events::stream,
        crate::http::webhooks::create,
        crate::http::webhooks::list,
        crate::http::webhooks::get,
        crate::http::webhooks::delete,
        crate::http::webhooks::deliveries,
    ),
    components(schemas(
        crate::webhooks::model::CreateWebhook,
        crate::webhooks::model::Webhook,
        crate::webhooks::model::Delivery,
        crate::webhooks::model::Attempt,
    ))
)]
struct EventsDoc;

/// The file routes, the streamed exec and the terminal session.
#[derive(OpenApi)]
#[openapi(
    paths(
        files::get,
        files::put,
        crate::exec_stream::exec_stream,
        crate::http::shell::shell
    ),
    components(schemas(files::DirectoryListing, files::FileEntry, files::FileWritten))
)]
struct FilesDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The document.
pub fn document() -> utoipa::openapi::OpenApi {
    let mut doc = ApiDoc::openapi();
    doc.merge(EventsDoc::openapi());
    doc.merge(FilesDoc::openapi());
    doc.info.description = Some(format!("{DESCRIPTION}{}", crate::webhooks::model::DOC));
    doc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_document_pages_keys_and_shows_hosts_schedulable_capacity() {
        let doc = serde_json::to_value(document()).unwrap();
        let params: Vec<&str> = doc["paths"]["/v1/keys"]["get"]["parameters"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|p| p["name"].as_str())
            .collect();
        assert_eq!(params, ["limit", "cursor"]);
        let ok = &doc["paths"]["/v1/keys"]["get"]["responses"]["200"];
        assert!(ok.to_string().contains("KeyList"), "{ok}");
        let schemas = &doc["components"]["schemas"];
        for field in ["keys", "next_cursor"] {
            assert!(
                schemas["KeyList"]["properties"][field].is_object(),
                "{field}"
            );
        }
        for field in [
            "capacity_vcpus",
            "schedulable_vcpus",
            "schedulable_memory_mib",
            "overcommit",
        ] {
            assert!(schemas["Host"]["properties"][field].is_object(), "{field}");
        }
        let host_id = schemas["Sandbox"]["properties"]["host_id"]["description"].to_string();
        assert!(host_id.contains("archived"), "{host_id}");
    }

    #[test]
    fn the_document_lists_every_lifecycle_route_and_the_state_table() {
        let doc = document();
        for path in [
            "/v1/sandboxes",
            "/v1/sandboxes/{id}",
            "/v1/sandboxes/{id}/stop",
            "/v1/sandboxes/{id}/archive",
            "/v1/sandboxes/{id}/start",
            "/v1/sandboxes/{id}/exec",
            "/v1/sandboxes/{id}/renew",
            "/v1/sandboxes/{id}/wait",
        ] {
            assert!(doc.paths.paths.contains_key(path), "{path}");
        }
        assert!(
            doc.paths.paths["/v1/sandboxes/{id}"].patch.is_some(),
            "PATCH /v1/sandboxes/{{id}}"
        );
        let description = doc.info.description.unwrap();
        for state in berth_schemas::SandboxState::ALL
            .iter()
            .filter(|s| s.is_written())
        {
            assert!(
                description.contains(&format!("| {:<14} |", state.as_str())),
                "{state}"
            );
        }
    }
}
