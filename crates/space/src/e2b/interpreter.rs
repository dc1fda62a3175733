//! The code interpreter's routes of E2B (`e2b-code-interpreter`), which its SDK sends
//! to `E2B_SANDBOX_URL` with `E2b-Sandbox-Port: 49999`: `POST /execute` (line-delimited
//! JSON), and `/contexts` (create, list, delete, restart). They run on the service's
//! code contexts (`space_service::interpreter`), like `/v1/sandboxes/{id}/contexts`.
//!
//! The SDK authenticates `/execute` with `X-Access-Token` and the context routes with
//! `E2B-Traffic-Access-Token`; the control plane hands out one token for both.

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use serde_json::{json, Value};
use space_api::{CreateContextRequest, ExecuteRequest};
use space_service::interpreter::MAX_EXECUTE_TIMEOUT;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::StreamExt;

use super::control::service_error;
use super::{envd_caller, E2bError, E2bState};

/// Where E2B's code interpreter starts its contexts.
const E2B_CWD: &str = "/home/user";

fn bad(message: impl Into<String>) -> E2bError {
    E2bError::new(StatusCode::BAD_REQUEST, message)
}

/// A JSON object body, or a 400.
fn object(body: &Bytes) -> Result<serde_json::Map<String, Value>, E2bError> {
    let text = if body.iter().all(u8::is_ascii_whitespace) {
        &b"{}"[..]
    } else {
        &body[..]
    };
    match serde_json::from_slice(text) {
        Ok(Value::Object(m)) => Ok(m),
        _ => Err(bad("the body must be a JSON object")),
    }
}

fn string_field(m: &serde_json::Map<String, Value>, key: &str) -> Result<Option<String>, E2bError> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(bad(format!("{key} must be a string"))),
    }
}

/// E2B's language names: `python` (the default) and `bash` run here; the SDK's others
/// (`javascript`, `typescript`, `r`, `java`) get a 400 that says so.
fn language(m: &serde_json::Map<String, Value>) -> Result<String, E2bError> {
    match string_field(m, "language")?.as_deref() {
        None | Some("" | "python" | "python3") => Ok("python".into()),
        Some("bash" | "sh") => Ok("bash".into()),
        Some(other) => Err(bad(format!(
            "language {:?} is not available: this server runs python and bash",
            space_service::truncate(other, 64)
        ))),
    }
}

/// `POST /execute {code, context_id?, language?, env_vars?}`: one JSON object a line,
/// as E2B's: `stdout`/`stderr` with a timestamp, `result`, `error`,
/// `number_of_executions`, `end_of_execution`.
pub async fn execute(State(st): State<E2bState>, headers: HeaderMap, body: Bytes) -> Response {
    let (tenant, sandbox) = match envd_caller(&st, &headers).await {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    execute_as(&st, &tenant, &sandbox, &body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn execute_as(
    st: &E2bState,
    tenant: &space_service::Tenant,
    sandbox: &str,
    body: &Bytes,
) -> Result<Response, E2bError> {
    let m = object(body)?;
    let code = match m.get("code") {
        Some(Value::String(c)) => c.clone(),
        _ => return Err(bad("code is required, a string")),
    };
    let env = match m.get("env_vars") {
        None | Some(Value::Null) => None,
        Some(Value::Object(vars)) => {
            let mut out = std::collections::BTreeMap::new();
            for (k, v) in vars {
                let Value::String(v) = v else {
                    return Err(bad("env_vars values must be strings"));
                };
                out.insert(k.clone(), v.clone());
            }
            Some(out)
        }
        Some(_) => return Err(bad("env_vars must be an object")),
    };
    let context = string_field(&m, "context_id")?;
    if context.is_some() && m.get("language").is_some_and(|l| !l.is_null()) {
        return Err(bad("give context_id or language, not both"));
    }
    // The SDK's own timeout bounds the call; when it gives up, the execution stops.
    let req = ExecuteRequest {
        code,
        timeout_seconds: Some(MAX_EXECUTE_TIMEOUT),
        env,
    };
    let scope = st.service.for_tenant(tenant);
    let run = match &context {
        Some(ctx) => scope.execute(sandbox, ctx, req).await,
        None => {
            let language = language(&m)?;
            scope
                .execute_default(sandbox, &language, Some(E2B_CWD), req)
                .await
        }
    };
    let run = run.map_err(service_error)?;
    let lines = ReceiverStream::new(run.events).map(|ev| {
        let mut out = Vec::new();
        for line in e2b_lines(ev) {
            out.extend(serde_json::to_vec(&line).unwrap_or_default());
            out.push(b'\n');
        }
        Ok::<_, std::convert::Infallible>(Bytes::from(out))
    });
    Ok(Response::builder()
        .header(header::CONTENT_TYPE, "application/x-ndjson")
        .body(Body::from_stream(lines))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response()))
}

/// One of our events as E2B's lines.
fn e2b_lines(mut ev: Value) -> Vec<Value> {
    let now = time::OffsetDateTime::now_utc().unix_timestamp_nanos() as i64;
    match ev["type"].as_str() {
        Some("stdout" | "stderr") => {
            ev["timestamp"] = json!(now);
            vec![ev]
        }
        Some("result" | "error") => vec![ev],
        Some("end") => {
            let mut out = Vec::new();
            if let Some(n) = ev["execution_count"].as_u64() {
                out.push(json!({"type": "number_of_executions", "execution_count": n}));
            }
            out.push(json!({"type": "end_of_execution"}));
            out
        }
        _ => Vec::new(),
    }
}

/// `POST /contexts {language?, cwd?}`: `{id, language, cwd}`.
pub async fn create(State(st): State<E2bState>, headers: HeaderMap, body: Bytes) -> Response {
    let (tenant, sandbox) = match envd_caller(&st, &headers).await {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    let fields = object(&body).and_then(|m| Ok((language(&m)?, string_field(&m, "cwd")?)));
    let (language, cwd) = match fields {
        Ok(f) => f,
        Err(e) => return e.into_response(),
    };
    let req = CreateContextRequest {
        language: Some(language),
        cwd: Some(cwd.unwrap_or_else(|| E2B_CWD.into())),
    };
    match st
        .service
        .for_tenant(&tenant)
        .create_context(&sandbox, req)
        .await
    {
        Ok(ctx) => axum::Json(ctx).into_response(),
        Err(e) => service_error(e).into_response(),
    }
}

/// `GET /contexts`: a JSON array of contexts.
pub async fn list(State(st): State<E2bState>, headers: HeaderMap) -> Response {
    let (tenant, sandbox) = match envd_caller(&st, &headers).await {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    match st.service.for_tenant(&tenant).list_contexts(&sandbox).await {
        Ok(all) => axum::Json(all).into_response(),
        Err(e) => service_error(e).into_response(),
    }
}

/// `DELETE /contexts/{id}`: 204.
pub async fn delete(st: State<E2bState>, headers: HeaderMap, ctx: Path<String>) -> Response {
    on_context(st, headers, ctx, false).await
}

/// `POST /contexts/{id}/restart`: 204.
pub async fn restart(st: State<E2bState>, headers: HeaderMap, ctx: Path<String>) -> Response {
    on_context(st, headers, ctx, true).await
}

/// Restarts or deletes a context: 204.
async fn on_context(
    State(st): State<E2bState>,
    headers: HeaderMap,
    Path(ctx): Path<String>,
    restart: bool,
) -> Response {
    let (tenant, sandbox) = match envd_caller(&st, &headers).await {
        Ok(c) => c,
        Err(r) => return r.into_response(),
    };
    let scope = st.service.for_tenant(&tenant);
    let done = match restart {
        true => scope.restart_context(&sandbox, &ctx).await,
        false => scope.delete_context(&sandbox, &ctx).await,
    };
    match done {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => service_error(e).into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_become_e2b_lines() {
        let out = e2b_lines(json!({"type": "stdout", "text": "a"}));
        assert_eq!(out[0]["text"], "a");
        assert!(out[0]["timestamp"].as_i64().unwrap() > 0);
        let out = e2b_lines(json!({"type": "end", "execution_count": 3, "duration_ms": 1}));
        assert_eq!(
            out[0],
            json!({"type": "number_of_executions", "execution_count": 3})
        );
        assert_eq!(out[1], json!({"type": "end_of_execution"}));
        assert!(e2b_lines(json!({"type": "accepted"})).is_empty());
    }

    #[test]
    fn only_python_and_bash_run() {
        let m = |v: Value| v.as_object().unwrap().clone();
        assert_eq!(language(&m(json!({}))).unwrap(), "python");
        assert_eq!(language(&m(json!({"language": "bash"}))).unwrap(), "bash");
        assert!(language(&m(json!({"language": "r"}))).is_err());
        assert!(language(&m(json!({"language": 1}))).is_err());
    }
}
