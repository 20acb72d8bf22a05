//! `write-sticker` and `read-sticker` with `stickerLocation: "volume"` on the real engine: the
//! sticker goes into a named volume through the archive upload on a created, never started
//! helper container, is read back the same way, and no helper is left behind. The volume's
//! file is also read from its host mountpoint, so the check does not rest on our own reader.

use berth_exec::builtin::Stickers;
use berth_exec::sticker::StickerStore;
use berth_exec::Executor;
use berth_proto::kind::TaskKind;
use berth_proto::payload::ReadStickerPayload;
use berth_test_utils::docker::*;
use serde_json::json;

#[tokio::test]
async fn a_volume_sticker_is_written_and_read_back_through_the_engine() {
    let Some(env) = env("a_volume_sticker_is_written_and_read_back_through_the_engine") else {
        return;
    };
    let prefix = unique("berth-test");
    let _cleanup = Cleanup::new(&prefix);
    let image = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v1", None);
    // The deployed image is on the host, as it is after a docker.run.
    let (ok, out) = docker(&["pull", &image.reference()]);
    assert!(ok, "docker pull: {out}");
    let volume = format!("{prefix}-sticker");
    let dir = tempfile::tempdir().unwrap();
    let stickers = Stickers(StickerStore::new(dir.path().join("stickers")));

    let write = json!({
        "name": "web", "releaseId": "r1", "releaseName": "one",
        "image": image.repository, "digest": image.digest,
        "stickerLocation": "volume", "stickerVolume": volume, "stickerPath": "berth/web.json",
    });
    let outcome = stickers.execute(&task("write-sticker", write)).await;
    assert_success(&outcome);

    // On the volume itself, seen from the host.
    let (ok, mountpoint) = docker(&["volume", "inspect", "-f", "{{.Mountpoint}}", &volume]);
    assert!(ok, "docker volume inspect: {mountpoint}");
    let file = std::path::Path::new(mountpoint.trim()).join("berth/web.json");
    let on_disk: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert_eq!(on_disk["name"], "web");
    assert_eq!(on_disk["releaseId"], "r1");
    assert_eq!(on_disk["digest"], image.digest.as_str());
    // Nothing went to the agent's sticker directory.
    assert!(!dir.path().join("stickers/web.json").exists());

    let read = json!({
        "name": "web", "stickerLocation": "volume", "stickerVolume": volume,
        "stickerPath": "berth/web.json", "stickerImage": image.reference(),
    });
    let outcome = stickers.execute(&task("read-sticker", read.clone())).await;
    assert_success(&outcome);
    let sticker = &outcome.outputs["sticker"];
    assert_eq!(sticker["releaseId"], "r1", "{sticker}");
    assert_eq!(sticker["releaseName"], "one");
    assert_eq!(sticker["digest"], image.digest.as_str());

    // A second write replaces it; a path with nothing there reads as no sticker.
    let rewrite = json!({
        "name": "web", "releaseId": "r2", "image": image.repository, "digest": image.digest,
        "stickerLocation": "volume", "stickerVolume": volume, "stickerPath": "berth/web.json",
    });
    assert_success(&stickers.execute(&task("write-sticker", rewrite)).await);
    let outcome = stickers.execute(&task("read-sticker", read)).await;
    assert_eq!(outcome.outputs["sticker"]["releaseId"], "r2");
    let missing = json!({
        "name": "web", "stickerLocation": "volume", "stickerVolume": volume,
        "stickerPath": "nothing.json", "stickerImage": image.reference(),
    });
    let outcome = stickers.execute(&task("read-sticker", missing)).await;
    assert_success(&outcome);
    assert!(
        outcome.outputs["sticker"].is_null(),
        "{:?}",
        outcome.outputs
    );

    // Every helper container was removed.
    let (_, helpers) = docker(&["ps", "-aq", "--filter", &format!("volume={volume}")]);
    assert_eq!(helpers.trim(), "", "helper containers left behind");

    // Refused before the engine is asked: a path out of the volume, a volume sticker with no
    // image to make the helper from, volume fields without the volume location.
    for bad in [
        json!({"name": "web", "stickerLocation": "volume", "stickerVolume": volume,
               "stickerPath": "../escape.json", "image": image.repository, "digest": image.digest}),
        json!({"name": "web", "stickerLocation": "volume", "stickerVolume": volume,
               "stickerPath": "/abs.json", "image": image.repository, "digest": image.digest}),
        json!({"name": "web", "stickerLocation": "volume", "stickerVolume": volume}),
        json!({"name": "web", "stickerVolume": volume}),
        json!({"name": "web", "stickerLocation": "volume", "stickerVolume": "../v",
               "image": image.repository, "digest": image.digest}),
    ] {
        let outcome = stickers.execute(&task("write-sticker", bad.clone())).await;
        assert_failed(&outcome, "INVALID_PAYLOAD");
    }
    let (_, helpers) = docker(&["ps", "-aq", "--filter", &format!("volume={volume}")]);
    assert_eq!(helpers.trim(), "");
}

/// `docker.run` with `stickerLocation: "volume"` writes its sticker into the volume, and the
/// read-back the server would queue for it (`TaskKind::read_back_volume`) reads it there.
#[tokio::test]
async fn a_docker_run_sticker_goes_into_the_volume_its_read_back_reads() {
    let Some(env) = env("a_docker_run_sticker_goes_into_the_volume_its_read_back_reads") else {
        return;
    };
    let prefix = unique("berth-test");
    let _cleanup = Cleanup::new(&prefix);
    let image = make_image(&env.registry, &prefix, "web", Variant::Healthy, "v1", None);
    let dir = tempfile::tempdir().unwrap();
    let store = StickerStore::new(dir.path().join("stickers"));
    let name = format!("{prefix}-web");
    let volume = format!("{prefix}-sticker");
    let port = berth_test_utils::free_port();
    let mut payload = image.deploy(&name, port, berth_test_utils::deploy::http_check(port, 30));
    payload["config"]["stickerLocation"] = json!("volume");
    payload["config"]["stickerVolume"] = json!(volume);

    let exec = berth_exec::DockerExecutor::new(store.clone());
    let outcome = exec.execute(&task("docker.run", payload.clone())).await;
    assert_success(&outcome);
    assert!(
        outcome.logs.contains(&format!("in volume {volume}")),
        "{}",
        outcome.logs
    );
    assert!(
        store.read(&name).unwrap().is_none(),
        "nothing in the sticker directory"
    );

    let where_ = TaskKind::DockerRun.read_back_volume(&payload).unwrap();
    let read = serde_json::to_value(ReadStickerPayload::in_volume(&name, where_)).unwrap();
    let outcome = Stickers(store).execute(&task("read-sticker", read)).await;
    assert_success(&outcome);
    let sticker = &outcome.outputs["sticker"];
    assert_eq!(sticker["name"], name.as_str(), "{sticker}");
    assert_eq!(sticker["digest"], image.digest.as_str());
    assert_eq!(
        sticker["extra"]["containerId"],
        json!(container_id(&name).unwrap())
    );
    let (_, helpers) = docker(&["ps", "-aq", "--filter", &format!("volume={volume}")]);
    assert_eq!(helpers.trim(), "", "helper containers left behind");
}
