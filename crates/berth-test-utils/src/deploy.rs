//! `docker.run` payloads and health-check configs, as the executor and the server take them.

use serde_json::{json, Value};

/// A `docker.run` payload for `repository@digest` as container `name`, published on loopback
/// `port` (the test images serve on 8080), with `health` as its health check.
pub fn deploy(repository: &str, digest: &str, name: &str, port: u16, health: Value) -> Value {
    json!({
        "image": repository,
        "digest": digest,
        "config": {
            "containerName": name,
            "releaseId": format!("{name}-release"),
            "releaseName": format!("{name}-1"),
            "ports": [format!("127.0.0.1:{port}:8080/tcp")],
            "restartPolicy": "no",
            "healthCheck": health,
        },
    })
}

/// An HTTP health check of `http://127.0.0.1:port/`, polled every second up to `timeout` s.
pub fn http_check(port: u16, timeout: u64) -> Value {
    json!({"type": "http", "url": format!("http://127.0.0.1:{port}/"), "timeout": timeout, "interval": 1})
}

/// The image's own HEALTHCHECK, polled every second up to `timeout` s.
pub fn docker_check(timeout: u64) -> Value {
    json!({"type": "docker", "timeout": timeout, "interval": 1})
}
