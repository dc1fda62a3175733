//! `/v1/templates`: list, build from a recipe (an operation), delete.

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use space_api::TemplateList;
use space_runtime::build::{Recipe, MAX_RECIPE_BYTES};

use super::tenancy::{template_tenant, template_visible, Tenant};
use super::{error, respond, respond_with, AppState, HttpError};

/// Built-in templates and the caller's own.
pub async fn list(State(st): State<AppState>, Extension(tenant): Extension<Tenant>) -> Response {
    let store = st.service.store();
    let r = st.service.list_templates().and_then(|all| {
        let mut templates = Vec::new();
        for t in all {
            if template_visible(store, &tenant, &t.name)? {
                templates.push(t);
            }
        }
        Ok(TemplateList { templates })
    });
    respond(r)
}

/// Makes `name` the caller's template name (a name is one tenant's until its
/// template is deleted): 409 when another tenant's template has it. `Ok(true)`
/// when this call made the claim (undo it with [`unclaim`] if the build is refused).
pub(super) fn claim(st: &AppState, tenant: &Tenant, name: &str) -> Result<bool, Box<Response>> {
    let store = st.service.store();
    let taken = || {
        Box::new(error(
            StatusCode::CONFLICT,
            "conflict",
            format!(
                "the template name {:?} is taken: choose another",
                crate::service::truncate(name, 64)
            ),
        ))
    };
    let internal = |e: crate::service::ServiceError| Box::new(HttpError(e).into_response());
    // Built-in names are refused by the build itself, with its own message.
    if template_tenant(store, name).map_err(internal)?.is_none() {
        return Ok(false);
    }
    match store.template_owner(name).map_err(|e| internal(e.into()))? {
        Some(owner) if owner == tenant.as_str() => Ok(false),
        Some(_) => Err(taken()),
        None => {
            // A template built before tenants existed belongs to `default`.
            let exists = st
                .service
                .list_templates()
                .map_err(internal)?
                .iter()
                .any(|t| t.name == name);
            if exists && tenant.as_str() != space_api::DEFAULT_TENANT {
                return Err(taken());
            }
            match store.claim_template(name, tenant.as_str()) {
                Ok(true) => Ok(!exists),
                Ok(false) => Err(taken()),
                Err(e) => Err(internal(e.into())),
            }
        }
    }
}

/// Gives back a name claimed for a build that was refused before it started.
pub(super) fn unclaim(st: &AppState, name: &str) {
    if let Err(e) = st.service.store().release_template(name) {
        tracing::warn!(error = %e, "releasing a template name");
    }
}

/// `POST /v1/templates`: a recipe (JSON, unknown fields refused, at most `MAX_RECIPE_BYTES`:
/// files are inlined) → 202 + a `build` operation.
pub async fn build(
    State(st): State<AppState>,
    Extension(tenant): Extension<Tenant>,
    req: Request,
) -> Response {
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            format!("recipe larger than {MAX_RECIPE_BYTES} bytes"),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > MAX_RECIPE_BYTES as u64) {
        return too_large();
    }
    let body: Body = req.into_body();
    let Ok(bytes) = axum::body::to_bytes(body, MAX_RECIPE_BYTES).await else {
        return too_large();
    };
    let recipe: Recipe = match serde_json::from_slice(&bytes) {
        Ok(r) => r,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_json",
                format!("invalid recipe: {e}"),
            )
        }
    };
    if let Some(base) = recipe.base.strip_prefix("template:") {
        match template_visible(st.service.store(), &tenant, base) {
            Ok(true) => {}
            Ok(false) => {
                return error(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    format!(
                        "unknown base template {:?}",
                        crate::service::truncate(base, 64)
                    ),
                )
            }
            Err(e) => return HttpError(e).into_response(),
        }
    }
    let name = recipe.name.clone();
    let claimed = match claim(&st, &tenant, &name) {
        Ok(c) => c,
        Err(r) => return *r,
    };
    let r = st.service.build_template(recipe);
    if r.is_err() && claimed {
        unclaim(&st, &name);
    }
    respond_with(StatusCode::ACCEPTED, r)
}

/// `DELETE /v1/templates/{name}`: 204, 404 unknown, 409 built in or in use.
pub async fn delete(State(st): State<AppState>, Path(name): Path<String>) -> Response {
    match st.service.delete_template(&name).await {
        Ok(()) => {
            if let Err(e) = st.service.store().release_template(&name) {
                return HttpError(e.into()).into_response();
            }
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => HttpError(e).into_response(),
    }
}
