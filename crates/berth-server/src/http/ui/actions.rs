//! The UI's actions (form POSTs): plan, deploy, roll back, verify, approve. Each checks the session's
//! CSRF token first, then calls the API's handler as the session's token, so the API's roles
//! decide (a viewer gets the API's `403 FORBIDDEN`, whatever the page showed). Success answers
//! 303 to the page to look at next; a refusal re-renders the page with it, at its status.

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Redirect, Response};
use axum::Form;
use berth_proto::deploy::CreateDeployment;
use berth_proto::DeploymentId;
use serde::Deserialize;

use super::layout::{error_page, page_response};
use super::pages::{caller, deployment_page, environment_page, percent};
use super::session::UiCaller;
use crate::infra::error::ApiError;
use crate::services;
use crate::SharedState;

#[derive(Deserialize)]
pub struct ActionForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    release: String,
}

/// The environment page again, showing `refusal` at its status.
async fn environment_refused(
    state: &SharedState,
    ui: &UiCaller,
    name: &str,
    refusal: ApiError,
) -> Response {
    match environment_page(state, ui, name, None, Some(&refusal)).await {
        Ok(markup) => page_response(refusal.status, markup),
        Err(_) => error_page(&refusal),
    }
}

fn deployment_request(name: &str, form: &ActionForm) -> CreateDeployment {
    CreateDeployment {
        release: form.release.trim().to_string(),
        environment: name.to_string(),
    }
}

/// `POST /environments/{name}/plan`: the dry run, shown with the confirm form.
pub async fn plan(
    State(state): State<SharedState>,
    ui: UiCaller,
    Path(name): Path<String>,
    Form(form): Form<ActionForm>,
) -> Response {
    if let Err(e) = ui.check_csrf(&form.csrf) {
        return error_page(&e);
    }
    let request = deployment_request(&name, &form);
    match services::environments::plan(&state, &caller(&ui), request).await {
        Ok(plan) => match environment_page(&state, &ui, &name, Some(&plan), None).await {
            Ok(markup) => page_response(StatusCode::OK, markup),
            Err(e) => error_page(&e),
        },
        Err(e) => environment_refused(&state, &ui, &name, e).await,
    }
}

/// `POST /environments/{name}/deploy`: creates the deployment, then shows it.
pub async fn deploy(
    State(state): State<SharedState>,
    ui: UiCaller,
    Path(name): Path<String>,
    Form(form): Form<ActionForm>,
) -> Response {
    if let Err(e) = ui.check_csrf(&form.csrf) {
        return error_page(&e);
    }
    let request = deployment_request(&name, &form);
    match services::environments::create(&state, &caller(&ui), request).await {
        Ok((_, view)) => Redirect::to(&format!("/deployments/{}", view.id)).into_response(),
        Err(e) => environment_refused(&state, &ui, &name, e).await,
    }
}

/// `POST /environments/{name}/rollback`: deploys the previous release, then shows it.
pub async fn rollback(
    State(state): State<SharedState>,
    ui: UiCaller,
    Path(name): Path<String>,
    Form(form): Form<ActionForm>,
) -> Response {
    if let Err(e) = ui.check_csrf(&form.csrf) {
        return error_page(&e);
    }
    match services::environments::rollback_environment(&state, &caller(&ui), name.clone()).await {
        Ok((_, view)) => Redirect::to(&format!("/deployments/{}", view.id)).into_response(),
        Err(e) => environment_refused(&state, &ui, &name, e).await,
    }
}

/// `POST /environments/{name}/verify`: asks for a fresh readiness pass, then shows the
/// environment, whose conditions follow the pass live.
pub async fn verify(
    State(state): State<SharedState>,
    ui: UiCaller,
    Path(name): Path<String>,
    Form(form): Form<ActionForm>,
) -> Response {
    if let Err(e) = ui.check_csrf(&form.csrf) {
        return error_page(&e);
    }
    match services::environments::verify(&state, &caller(&ui), name.clone()).await {
        Ok(_) => {
            Redirect::to(&format!("/environments/{}#readiness", percent(&name))).into_response()
        }
        Err(e) => environment_refused(&state, &ui, &name, e).await,
    }
}

/// `POST /deployments/{id}/approve`.
pub async fn approve(
    State(state): State<SharedState>,
    ui: UiCaller,
    Path(id): Path<String>,
    Form(form): Form<ActionForm>,
) -> Response {
    if let Err(e) = ui.check_csrf(&form.csrf) {
        return error_page(&e);
    }
    let Ok(deployment) = id.parse::<DeploymentId>() else {
        return error_page(&ApiError::not_found("deployment"));
    };
    match services::environments::approve(&state, &caller(&ui), deployment).await {
        Ok(_) => Redirect::to(&format!("/deployments/{deployment}")).into_response(),
        Err(e) => match deployment_page(&state, &ui, &id, Some(&e)).await {
            Ok(markup) => page_response(e.status, markup),
            Err(_) => error_page(&e),
        },
    }
}
