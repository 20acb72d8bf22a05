//! Stickers in named Docker volumes (`stickerLocation: "volume"`). The volume is reached only
//! through the Engine API: a helper container that mounts it at [`VolumeSticker::MOUNT`] is
//! created from the sticker's image and never started (no shell, no command runs), the sticker
//! goes in by `PUT /containers/{id}/archive` and comes back by `GET …/archive`, and the helper
//! is removed on every path. A volume that does not exist yet is created by the engine.
//! Unlike the directory store there is no `history.log`, and the upload replaces the file in
//! place rather than by a rename.
//!
//! Its own file because it goes through the engine (`crate::engine`), which reports a failed
//! sticker write through `ExecError::Sticker`: the directory store stays free of the engine.

use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, DownloadFromContainerOptionsBuilder,
    RemoveContainerOptionsBuilder, UploadToContainerOptionsBuilder,
};
use bollard::Docker;
use futures_util::TryStreamExt;

pub use berth_proto::payload::VolumeSticker;

use super::Sticker;
use crate::engine::engine_error;
use crate::error::ExecError;

/// A sticker file is a few hundred bytes; anything near this is not one.
const MAX_STICKER_BYTES: u64 = 1 << 20;

/// Writes `sticker` as `target.path` in `target.volume`.
pub async fn write(
    docker: &Docker,
    target: &VolumeSticker,
    sticker: &Sticker,
) -> Result<(), ExecError> {
    let json = serde_json::to_vec_pretty(sticker)
        .map_err(|e| ExecError::StickerUnreadable(format!("sticker {}: {e}", sticker.name)))?;
    let tar = berth_bundle::to_tar(&std::collections::BTreeMap::from([(
        target.path.clone(),
        json,
    )]));
    with_helper(docker, target, |id| async move {
        let options = UploadToContainerOptionsBuilder::default()
            .path(VolumeSticker::MOUNT)
            .build();
        docker
            .upload_to_container(&id, Some(options), bollard::body_full(tar.into()))
            .await
            .map_err(|e| engine_error("upload the sticker into", &target.volume, e))
    })
    .await
}

/// The sticker at `target.path` in `target.volume`; `None` when there is no such file.
pub async fn read(docker: &Docker, target: &VolumeSticker) -> Result<Option<Sticker>, ExecError> {
    let bytes = with_helper(docker, target, |id| async move {
        let options = DownloadFromContainerOptionsBuilder::default()
            .path(&format!("{}/{}", VolumeSticker::MOUNT, target.path))
            .build();
        let mut stream = docker.download_from_container(&id, Some(options));
        let mut out = Vec::new();
        loop {
            match stream.try_next().await {
                Ok(Some(chunk)) => {
                    out.extend_from_slice(&chunk);
                    if out.len() as u64 > MAX_STICKER_BYTES + 64 * 1024 {
                        return Err(ExecError::StickerUnreadable(format!(
                            "sticker {} in volume {} is over {MAX_STICKER_BYTES} bytes",
                            target.path, target.volume
                        )));
                    }
                }
                Ok(None) => return Ok(Some(out)),
                Err(bollard::errors::Error::DockerResponseServerError {
                    status_code: 404, ..
                }) => return Ok(None),
                Err(e) => return Err(engine_error("read the sticker from", &target.volume, e)),
            }
        }
    })
    .await?;
    let Some(bytes) = bytes else {
        return Ok(None);
    };
    let limits = berth_bundle::Limits {
        max_member_bytes: MAX_STICKER_BYTES,
        max_total_bytes: MAX_STICKER_BYTES,
        max_members: 1,
    };
    let unreadable = |why: String| {
        ExecError::StickerUnreadable(format!(
            "sticker {} in volume {}: {why}",
            target.path, target.volume
        ))
    };
    let files = berth_bundle::read_tar(&bytes, &limits).map_err(|e| unreadable(e.to_string()))?;
    // The engine names the one member by the file's base name.
    let (_, json) = files
        .into_iter()
        .next()
        .ok_or_else(|| unreadable("the archive holds no regular file".into()))?;
    serde_json::from_slice(&json)
        .map(Some)
        .map_err(|e| unreadable(format!("not valid JSON: {e}")))
}

/// Runs `f` with a created, never started helper container that mounts the volume, and
/// removes the helper afterwards whatever `f` returned.
async fn with_helper<T, F, Fut>(
    docker: &Docker,
    target: &VolumeSticker,
    f: F,
) -> Result<T, ExecError>
where
    F: FnOnce(String) -> Fut,
    Fut: std::future::Future<Output = Result<T, ExecError>>,
{
    let name = format!("berth-sticker-{}", uuid::Uuid::new_v4().simple());
    let body = ContainerCreateBody {
        image: Some(target.image.clone()),
        // Never started; an entrypoint is set only so that an image without one can be
        // created at all. It names nothing that exists.
        entrypoint: Some(vec!["/berth-sticker-helper-never-runs".into()]),
        cmd: Some(vec![]),
        network_disabled: Some(true),
        labels: Some(std::collections::HashMap::from([(
            "berth.sticker-helper".to_string(),
            "true".to_string(),
        )])),
        host_config: Some(HostConfig {
            binds: Some(vec![format!("{}:{}", target.volume, VolumeSticker::MOUNT)]),
            network_mode: Some("none".into()),
            ..Default::default()
        }),
        ..Default::default()
    };
    let options = CreateContainerOptionsBuilder::default().name(&name).build();
    let created = docker
        .create_container(Some(options), body)
        .await
        .map_err(|e| engine_error("create the sticker helper for", &target.volume, e))?;
    let result = f(created.id.clone()).await;
    let remove = RemoveContainerOptionsBuilder::default().force(true).build();
    if let Err(e) = docker.remove_container(&created.id, Some(remove)).await {
        tracing::warn!(container = %name, error = %e, "could not remove the sticker helper");
    }
    result
}
