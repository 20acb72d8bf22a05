//! The OpenAPI document, generated from the handlers' annotations through the router that serves
//! them (`routes::declared`). A test compares it with the committed `openapi/berth.json`, so the
//! contract cannot drift silently.
//!
//! A handler's annotation lists the answers its own code gives. The answers an operation gives
//! because of what it *is* — how it authenticates, which parameters and body it takes — are
//! added here, once, by [`common_refusals`]: the extractors that give them (`auth.rs`,
//! `extract.rs`) and the connection (`routes::headers_too_large`) serve every route alike.

use std::collections::BTreeMap;

use berth_proto::error::codes;
use utoipa::openapi::path::{Operation, ParameterIn};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{ContentBuilder, Ref, RefOr, ResponseBuilder};
use utoipa::{Modify, OpenApi};

/// The security scheme of API tokens (`auth::Caller`).
pub const BEARER: &str = "bearer";
/// The security scheme of agent-runtime calls (`auth::AgentCaller`, `auth::FencedAgent`): the
/// agent's client certificate. Every agent route names it in `security(...)`.
pub const AGENT_CERTIFICATE: &str = "agentCertificate";

#[derive(OpenApi)]
#[openapi(
    info(title = "berth", description = "berth control plane API"),
    // What an event stream message's `data` carries: not referenced by any response, since
    // SSE messages are described as SSE frames them (`EventMessage`). Likewise the task
    // stream's messages, which travel as WebSocket frames.
    components(schemas(
        berth_proto::event::EventView,
        berth_proto::event::TaskStateEvent,
        berth_proto::event::AgentEvent,
        // The task stream's messages, each way (WebSocket frames, not an HTTP body).
        berth_proto::transport::TaskStreamMessage,
        berth_proto::transport::TaskStreamRequest,
        // The `order` query parameter of the task and deployment lists refers to it.
        berth_proto::task::ListOrder
    )),
    modifiers(&SecuritySchemes),
)]
struct ApiDoc;

struct SecuritySchemes;

impl Modify for SecuritySchemes {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            BEARER,
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
        components.add_security_scheme(
            AGENT_CERTIFICATE,
            SecurityScheme::MutualTls {
                description: Some(
                    "the agent's client certificate, issued at registration or renewal; it \
                     must be the one currently bound to the agent the path names"
                        .into(),
                ),
                extensions: None,
            },
        );
    }
}

/// The document's title and security schemes; the routes add the paths and schemas.
pub(crate) fn document_base() -> utoipa::openapi::OpenApi {
    ApiDoc::openapi()
}

/// The document as pretty JSON, with a fixed version so it only changes when the API does.
pub fn openapi_json() -> String {
    let mut doc = crate::http::routes::declared().into_openapi();
    doc.info.version = "v1".to_string();
    // axum spells a parameter that spans segments `{*path}`; OpenAPI has only `{path}`.
    let wildcards: Vec<String> = doc
        .paths
        .paths
        .keys()
        .filter(|p| p.contains("{*"))
        .cloned()
        .collect();
    for path in wildcards {
        if let Some(item) = doc.paths.paths.remove(&path) {
            doc.paths.paths.insert(path.replace("{*", "{"), item);
        }
    }
    CommonResponses.modify(&mut doc);
    name_operations(&mut doc);
    doc.to_pretty_json().unwrap_or_else(|_| "{}".to_string())
}

/// Operation ids a generated client can name its methods by, unique in the document: a
/// handler named by a bare verb (`tasks::list`) gets its tag's resource (`listTasks`; one item:
/// `getTask`), any other its own name in camelCase (`create_environment` → `createEnvironment`,
/// `healthz` → `healthz`).
fn name_operations(doc: &mut utoipa::openapi::OpenApi) {
    for item in doc.paths.paths.values_mut() {
        for op in [
            &mut item.get,
            &mut item.put,
            &mut item.post,
            &mut item.delete,
            &mut item.patch,
        ]
        .into_iter()
        .flatten()
        {
            let Some(id) = op.operation_id.as_deref() else {
                continue;
            };
            let tag = op.tags.as_ref().and_then(|t| t.first()).map(String::as_str);
            op.operation_id = Some(operation_id(id, tag.unwrap_or_default()));
        }
    }
}

/// See [`name_operations`].
fn operation_id(handler: &str, tag: &str) -> String {
    let camel = |words: &mut dyn Iterator<Item = &str>| -> String {
        words
            .filter(|w| !w.is_empty())
            .map(|w| {
                let mut c = w.chars();
                c.next()
                    .map(|f| f.to_ascii_uppercase().to_string() + c.as_str())
                    .unwrap_or_default()
            })
            .collect()
    };
    const ON_MANY: [&str; 2] = ["list", "stream"];
    const ON_ONE: [&str; 17] = [
        "get", "create", "update", "delete", "cancel", "retry", "approve", "plan", "cordon",
        "uncordon", "suspend", "resume", "resend", "kit", "register", "verify", "retire",
    ];
    let resource = camel(&mut tag.split(['-', '_']));
    let one = resource.strip_suffix('s').unwrap_or(&resource);
    if ON_MANY.contains(&handler) {
        format!("{handler}{resource}")
    } else if ON_ONE.contains(&handler) {
        format!("{handler}{one}")
    } else {
        let mut words = handler.split('_');
        let first = words.next().unwrap_or_default().to_string();
        first + &camel(&mut words)
    }
}

/// A refusal an operation gives because of its declaration: `(status, code, why)`.
type Refusal = (u16, &'static str, &'static str);

/// What every agent-certificate operation may answer before its handler runs.
const AGENT_REFUSALS: [Refusal; 4] = [
            (
                401,
                codes::CLIENT_CERT_REQUIRED,
                "the connection presented no client certificate",
            ),
            (
                401,
                codes::CLIENT_CERT_EXPIRED,
                "the client certificate expired after the connection's handshake",
            ),
            (
                401,
                codes::CERTIFICATE_SUPERSEDED,
                "the certificate is the one the agent's last renewal replaced: send again with the new one",
            ),
            (
                401,
                codes::AGENT_REVOKED,
                "the certificate is no longer bound to an agent (deleted, or replaced before the last renewal): register again",
            ),
];

/// What every operation with a JSON body may answer before its handler runs.
const BODY_REFUSALS: [Refusal; 5] = [
            (400, codes::MALFORMED_JSON, "the body is not JSON"),
            (400, codes::INVALID_REQUEST, "the body could not be read"),
            (
                413,
                codes::PAYLOAD_TOO_LARGE,
                "the body is larger than the server accepts",
            ),
            (
                415,
                codes::UNSUPPORTED_MEDIA_TYPE,
                "the Content-Type is not application/json",
            ),
            (
                422,
                codes::INVALID_REQUEST,
                "the JSON is not what this operation takes (a field missing, of the wrong type or out of range)",
            ),
];

/// The refusals every operation gives because of how it is declared. Its security requirement
/// says which auth extractor runs; a path, query or `X-Berth-Generation` parameter and a body
/// say which other extractors do.
fn common_refusals(op: &Operation) -> Vec<Refusal> {
    let schemes: Vec<String> = op
        .security
        .iter()
        .flatten()
        .filter_map(|requirement| match serde_json::to_value(requirement) {
            Ok(serde_json::Value::Object(names)) => Some(names.into_iter().map(|(name, _)| name)),
            _ => None,
        })
        .flatten()
        .collect();
    let params = op.parameters.iter().flatten();
    let in_path: Vec<&str> = params
        .clone()
        .filter(|p| p.parameter_in == ParameterIn::Path)
        .map(|p| p.name.as_str())
        .collect();
    let has_query = params.clone().any(|p| p.parameter_in == ParameterIn::Query);
    let fenced = params.clone().any(|p| {
        p.parameter_in == ParameterIn::Header
            && p.name
                .eq_ignore_ascii_case(berth_proto::headers::GENERATION_HEADER)
    });
    let bearer = schemes.iter().any(|s| s == BEARER);
    let agent = schemes.iter().any(|s| s == AGENT_CERTIFICATE);
    let body = op.request_body.is_some();

    let mut refusals: Vec<Refusal> = vec![(
        431,
        codes::HEADERS_TOO_LARGE,
        "the request headers are larger than the server reads",
    )];
    if bearer {
        refusals.push((
            401,
            codes::UNAUTHENTICATED,
            "no Bearer token, or not a known one",
        ));
    }
    if agent {
        refusals.extend(AGENT_REFUSALS);
        if in_path.iter().any(|p| matches!(*p, "id" | "agentId")) {
            refusals.push((
                403,
                codes::CERT_BINDING_MISMATCH,
                "the client certificate belongs to another agent than the path names",
            ));
        }
    }
    if fenced {
        refusals.push((
            409,
            codes::FENCED,
            "X-Berth-Generation is missing, malformed or not the current session's",
        ));
    }
    if !in_path.is_empty() {
        refusals.extend([
            (400, codes::INVALID_ID, "a path id is not a UUID"),
            (
                404,
                codes::NOT_FOUND,
                "no such object in the caller's tenant, or no route (an empty path segment)",
            ),
        ]);
    }
    if has_query {
        refusals.push((
            400,
            codes::INVALID_REQUEST,
            "an unknown or malformed query parameter",
        ));
    }
    if body {
        refusals.extend(BODY_REFUSALS);
    }
    if bearer || agent || body {
        refusals.push((
            500,
            codes::INTERNAL,
            "an unexpected failure, logged by the server; never an answer to bad input",
        ));
    }
    refusals
}

/// Adds [`common_refusals`] to every operation: a status the handler does not document gets a
/// response of its own; one it documents gets the codes its description does not name yet.
/// Every added response is an `ErrorBody`.
struct CommonResponses;

impl Modify for CommonResponses {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        for item in openapi.paths.paths.values_mut() {
            let operations = [
                &mut item.get,
                &mut item.put,
                &mut item.post,
                &mut item.delete,
                &mut item.patch,
            ];
            for op in operations.into_iter().flatten() {
                let mut by_status: BTreeMap<u16, Vec<(&str, &str)>> = BTreeMap::new();
                for (status, code, why) in common_refusals(op) {
                    by_status.entry(status).or_default().push((code, why));
                }
                for (status, refusals) in by_status {
                    let responses = &mut op.responses.responses;
                    match responses.get_mut(&status.to_string()) {
                        Some(RefOr::T(documented)) => {
                            for (code, why) in refusals {
                                if !names(&documented.description, code) {
                                    documented.description.push_str(&format!("; {code}: {why}"));
                                }
                            }
                        }
                        Some(RefOr::Ref(_)) => {}
                        None => {
                            let description = refusals
                                .iter()
                                .map(|(code, why)| format!("{code}: {why}"))
                                .collect::<Vec<_>>()
                                .join("; ");
                            let response = ResponseBuilder::new()
                                .description(description)
                                .content(
                                    "application/json",
                                    ContentBuilder::new()
                                        .schema(Some(Ref::from_schema_name("ErrorBody")))
                                        .build(),
                                )
                                .build();
                            responses.insert(status.to_string(), RefOr::T(response));
                        }
                    }
                }
            }
        }
    }
}

/// Whether `description` names `code` as a word (`CONFLICT` is not named by `CONSTRAINT_CONFLICT`).
fn names(description: &str, code: &str) -> bool {
    description
        .split(|c: char| !(c.is_ascii_uppercase() || c == '_'))
        .any(|word| word == code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operation_ids_name_the_verb_and_the_resource() {
        for (handler, tag, id) in [
            ("list", "tasks", "listTasks"),
            ("get", "deployments", "getDeployment"),
            ("cancel", "tasks", "cancelTask"),
            ("delete", "ssh-targets", "deleteSshTarget"),
            ("create_environment", "environments", "createEnvironment"),
            ("agent_kv", "agent-runtime", "agentKv"),
            ("healthz", "meta", "healthz"),
            ("stream", "events", "streamEvents"),
        ] {
            assert_eq!(operation_id(handler, tag), id, "{handler} {tag}");
        }
    }

    #[test]
    fn every_operation_id_is_unique() {
        let doc: serde_json::Value = serde_json::from_str(&openapi_json()).expect("json");
        let mut seen = std::collections::BTreeMap::new();
        for (path, item) in doc["paths"].as_object().expect("paths") {
            for (method, op) in item.as_object().expect("item") {
                if let Some(id) = op.get("operationId").and_then(|v| v.as_str()) {
                    if let Some(other) = seen.insert(id.to_string(), format!("{method} {path}")) {
                        panic!("{id} names both {other} and {method} {path}");
                    }
                }
            }
        }
        assert!(seen.len() > 50, "{seen:?}");
    }
}
