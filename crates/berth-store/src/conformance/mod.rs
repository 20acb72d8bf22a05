//! The conformance suite every [`Store`](crate::Store) backend must pass: one public function
//! per behaviour, each panicking on failure, in a module per domain (`tenants.rs`, `agents.rs`,
//! `tasks.rs`, `releases.rs`, `deployments.rs`, …; `support.rs` holds the fixtures they all
//! import, this file the cases that span domains). Each case makes its own tenant with a unique
//! name, so cases can share one database; none may assume an empty database or depend on
//! another case. [`conformance_cases!`](crate::conformance_cases) lists them all. Compiled only
//! with the `conformance` feature: the shipping library carries none of it.

use support::*;

mod agents;
mod audit;
mod claims;
mod deployments;
mod desired;
mod events;
mod notify;
mod readiness;
mod releases;
mod secrets;
mod ssh_targets;
mod support;
mod tasks;
mod tenants;

pub use agents::*;
pub use audit::*;
pub use claims::*;
pub use deployments::*;
pub use desired::*;
pub use events::*;
pub use notify::*;
pub use readiness::*;
pub use releases::*;
pub use secrets::*;
pub use ssh_targets::*;
pub use tasks::*;
pub use tenants::*;

/// Calls `$callback! { case, case, … }` with the name of every case, each a function
/// `berth_store::conformance::<case>(&DynStore)`. A test harness turns each into one test per
/// backend, so one failing case never hides another; a case added here reaches every harness.
#[macro_export]
macro_rules! conformance_cases {
    ($callback:ident) => {
        $callback! {
            ping_and_backend,
            tenants,
            api_tokens,
            ui_sessions,
            events_latest_id,
            registration_succeeds,
            registration_token_is_single_use,
            registration_token_expired,
            registration_token_unknown,
            registration_name_taken_keeps_token,
            registration_concurrent_single_use,
            registration_token_labels_and_environment,
            tenant_isolation,
            list_filters,
            list_pagination,
            update_agent,
            agent_holds,
            delete_agent,
            rebind_certificate,
            heartbeats,
            sweep_stale_agents,
            timestamps_round_trip,
            session_lease,
            session_conflict_degrades,
            session_restart_takeover,
            session_records_version,
            heartbeat_fencing,
            heartbeat_replay,
            task_create_idempotency,
            task_queue_cap,
            task_queue_cap_concurrent,
            task_claim_order,
            task_claim_unrunnable_heads_fail,
            open_task_counts,
            queued_tasks,
            task_claim_head_of_line,
            task_claim_fencing,
            task_result_from_a_newer_session,
            task_result_after_lease_deadline,
            task_claim_concurrent,
            task_path_concurrent,
            task_complete_transitions,
            task_stale_assignment,
            task_start_handshake,
            task_cancel,
            task_retry,
            lease_expiry,
            read_back_sweep,
            retention_prunes_what_finished_long_ago,
            retention_keeps_an_unknown_tasks_read_back,
            retention_keeps_the_store_bounded,
            delete_agent_tasks,
            task_tenant_isolation,
            list_tasks,
            task_events,
            release_create_get,
            release_create_concurrent,
            list_releases,
            audit_chain,
            audit_task_entries,
            audit_admin_entries,
            audit_concurrent_appends,
            events_of_task_and_agent_states,
            events_tenant_isolation,
            events_wake_readers,
            events_cursor_never_skips,
            environment_create_get_list,
            readiness_round_trip,
            readiness_verify_nonce,
            readiness_environments_listed,
            deployment_create_round_trip,
            deployment_one_active_per_environment,
            deployment_approvals,
            deployment_cancel,
            deployment_cancel_stops_a_racing_step,
            deployment_step_compare_and_set,
            environment_pin_and_unpin,
            secret_versions_and_delete,
            secret_concurrent_put_conflicts,
            grant_supersede_use_and_jwks,
            active_deployments_and_released_environments,
            target_observations_upsert,
            deployment_events,
            deployment_tenant_isolation,
            desired_bundles_and_set_desired,
            desired_checkins_and_reports,
            ssh_targets_create_get_delete,
            artifacts_content_addressed,
            notifications_written_with_events,
            notification_claims_and_outcomes,
            reconciler_claims,
        }
    };
}

// --- cases ---

pub async fn ping_and_backend(store: &DynStore) {
    store.ping().await.expect("ping");
    assert!(matches!(store.backend(), "sqlite" | "postgres"));
}

pub async fn timestamps_round_trip(store: &DynStore) {
    // Sub-millisecond digits and a non-UTC offset: both backends must return the same instant,
    // truncated to the millisecond, in UTC.
    let at = datetime!(2024-02-29 12:34:56.789_654_321 +02:00);
    let expected = datetime!(2024-02-29 10:34:56.789 UTC);
    assert_eq!(millis(at), expected);

    let tenant = store
        .create_tenant(TenantId::new(), &unique("timestamps"), operator(), at)
        .await
        .expect("create tenant");
    assert_eq!(tenant.created_at, expected);
    assert!(tenant.created_at.offset().is_utc());
    let read = store
        .get_tenant(tenant.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(read.created_at, expected);

    let hash = registration_token(
        store,
        tenant.id,
        BTreeMap::new(),
        None,
        at + Duration::hours(1),
    )
    .await;
    let mut agent = new_agent("clock");
    agent.created_at = at;
    agent.certificate_expires_at = at + Duration::days(30);
    let registered = store
        .register_agent(&hash, agent, at)
        .await
        .expect("register")
        .expect("accepted");
    assert_eq!(registered.created_at, expected);
    assert_eq!(registered.updated_at, expected);
    assert_eq!(
        registered.certificate_expires_at,
        Some(expected + Duration::days(30))
    );

    let beat_at = at + Duration::microseconds(300);
    assert_eq!(
        store
            .record_heartbeats(&[heartbeat(&registered, AgentStatus::Online, beat_at)])
            .await
            .expect("hb"),
        vec![Applied]
    );
    let read = store
        .get_agent(tenant.id, registered.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(
        read.last_heartbeat,
        Some(expected),
        "300 µs later is the same millisecond"
    );
    assert!(read.last_heartbeat.is_some_and(|t| t.offset().is_utc()));
    assert_eq!(read.updated_at, expected);
    assert_eq!(read.created_at, expected);

    let hash = token_hash();
    let token = store
        .create_api_token(NewApiToken {
            created_by: None,
            id: TokenId::new(),
            tenant_id: tenant.id,
            name: "clock".to_string(),
            role: Role::Viewer,
            operator: false,
            token_hash: hash.clone(),
            created_at: at,
        })
        .await
        .expect("create api token");
    assert_eq!(token.created_at, expected);
    assert_eq!(
        store
            .api_token_by_hash(&hash)
            .await
            .expect("lookup")
            .map(|t| t.created_at),
        Some(expected)
    );
}
