//! Conformance cases of agents: registration, listing, updates, the certificate binding,
//! heartbeats, staleness and session leases (fencing).

use super::support::*;

pub async fn registration_succeeds(store: &DynStore) {
    let tenant = tenant(store).await;
    let hash = registration_token(
        store,
        tenant.id,
        BTreeMap::new(),
        None,
        now() + Duration::hours(1),
    )
    .await;
    let mut agent = new_agent("web-1");
    agent.labels = labels(&[("role", "web")]);
    agent.capabilities = vec![capability("docker"), capability("compose")];
    let at = now();
    let registered = store
        .register_agent(&hash, agent.clone(), at)
        .await
        .expect("register")
        .expect("accepted");
    let expected = Agent {
        id: agent.id,
        tenant_id: tenant.id,
        name: "web-1".to_string(),
        version: agent.version.clone(),
        capabilities: agent.capabilities.clone(),
        labels: agent.labels.clone(),
        // No heartbeat yet: registered, not online (issue 9 item 8).
        status: AgentStatus::Registered,
        reported_status: AgentStatus::Registered,
        environment: None,
        last_heartbeat: None,
        resource_usage: None,
        certificate_fingerprint: Some(agent.certificate_fingerprint.clone()),
        certificate_expires_at: Some(millis(agent.certificate_expires_at)),
        previous_certificate_fingerprint: None,
        cordoned: false,
        suspended: false,
        // No session yet.
        generation: 0,
        created_at: millis(agent.created_at),
        updated_at: millis(agent.created_at),
    };
    assert_eq!(registered, expected);
    assert_eq!(
        store.get_agent(tenant.id, agent.id).await.expect("get"),
        Some(expected.clone())
    );
    assert_eq!(
        store
            .get_agent_for_runtime(agent.id)
            .await
            .expect("get runtime"),
        Some(expected)
    );
    assert_eq!(
        store
            .get_agent_for_runtime(AgentId::new())
            .await
            .expect("get unknown"),
        None
    );
}

pub async fn registration_token_is_single_use(store: &DynStore) {
    let tenant = tenant(store).await;
    let hash = registration_token(
        store,
        tenant.id,
        BTreeMap::new(),
        None,
        now() + Duration::hours(1),
    )
    .await;
    store
        .register_agent(&hash, new_agent("first"), now())
        .await
        .expect("register")
        .expect("first use accepted");
    let again = store
        .register_agent(&hash, new_agent("second"), now())
        .await
        .expect("register");
    assert_eq!(again, Err(RegisterError::TokenInvalid));
    assert_eq!(
        list_all(store, tenant.id, &AgentFilter::default())
            .await
            .len(),
        1
    );
}

pub async fn registration_token_expired(store: &DynStore) {
    let tenant = tenant(store).await;
    let at = now();
    let expired = registration_token(
        store,
        tenant.id,
        BTreeMap::new(),
        None,
        at - Duration::seconds(1),
    )
    .await;
    let result = store
        .register_agent(&expired, new_agent("late"), at)
        .await
        .expect("register");
    assert_eq!(result, Err(RegisterError::TokenInvalid));
    // A token is valid strictly before its expiry.
    let at_edge = registration_token(store, tenant.id, BTreeMap::new(), None, millis(at)).await;
    let result = store
        .register_agent(&at_edge, new_agent("edge"), millis(at))
        .await
        .expect("register");
    assert_eq!(result, Err(RegisterError::TokenInvalid));
    assert!(list_all(store, tenant.id, &AgentFilter::default())
        .await
        .is_empty());
}

pub async fn registration_token_unknown(store: &DynStore) {
    let result = store
        .register_agent(&token_hash(), new_agent("nobody"), now())
        .await
        .expect("register");
    assert_eq!(result, Err(RegisterError::TokenInvalid));
}

pub async fn registration_name_taken_keeps_token(store: &DynStore) {
    let tenant = tenant(store).await;
    register(store, tenant.id, new_agent("taken")).await;
    let hash = registration_token(
        store,
        tenant.id,
        BTreeMap::new(),
        None,
        now() + Duration::hours(1),
    )
    .await;
    let clash = store
        .register_agent(&hash, new_agent("taken"), now())
        .await
        .expect("register");
    assert_eq!(clash, Err(RegisterError::NameTaken));
    let retry = store
        .register_agent(&hash, new_agent("free"), now())
        .await
        .expect("register")
        .expect("the token survived the name clash");
    assert_eq!(retry.name, "free");

    // The same name in another tenant is no clash.
    let other = self::tenant(store).await;
    let elsewhere = register(store, other.id, new_agent("taken")).await;
    assert_eq!(elsewhere.tenant_id, other.id);
}

pub async fn registration_concurrent_single_use(store: &DynStore) {
    const CALLERS: usize = 20;
    let tenant = tenant(store).await;
    let hash = registration_token(
        store,
        tenant.id,
        BTreeMap::new(),
        None,
        now() + Duration::hours(1),
    )
    .await;
    let tasks: Vec<_> = (0..CALLERS)
        .map(|i| {
            let store = store.clone();
            let hash = hash.clone();
            tokio::spawn(async move {
                store
                    .register_agent(&hash, new_agent(&format!("racer-{i}")), now())
                    .await
            })
        })
        .collect();
    let mut accepted = 0;
    for task in tasks {
        match task
            .await
            .expect("task ran")
            .expect("no database error, no SQLITE_BUSY")
        {
            Ok(_) => accepted += 1,
            Err(e) => assert_eq!(e, RegisterError::TokenInvalid),
        }
    }
    assert_eq!(accepted, 1, "exactly one concurrent registration wins");
    assert_eq!(
        list_all(store, tenant.id, &AgentFilter::default())
            .await
            .len(),
        1
    );
}

pub async fn registration_token_labels_and_environment(store: &DynStore) {
    let tenant = tenant(store).await;
    let hash = registration_token(
        store,
        tenant.id,
        labels(&[("env", "prod"), ("team", "payments")]),
        Some("prod"),
        now() + Duration::hours(1),
    )
    .await;
    let mut agent = new_agent("db-1");
    agent.labels = labels(&[("team", "hobby"), ("role", "db")]);
    let registered = store
        .register_agent(&hash, agent, now())
        .await
        .expect("register")
        .expect("accepted");
    assert_eq!(
        registered.labels,
        labels(&[("env", "prod"), ("team", "payments"), ("role", "db")]),
        "token labels win over the agent's"
    );
    assert_eq!(registered.environment.as_deref(), Some("prod"));
}

pub async fn tenant_isolation(store: &DynStore) {
    let owner = tenant(store).await;
    let intruder = tenant(store).await;
    let agent = register(store, owner.id, new_agent("private")).await;

    assert_eq!(
        store.get_agent(intruder.id, agent.id).await.expect("get"),
        None
    );
    assert!(list_all(store, intruder.id, &AgentFilter::default())
        .await
        .is_empty());
    let update = AgentUpdate {
        updated_by: None,
        labels: Some(labels(&[("owned", "yes")])),
        capabilities: Some(vec![]),
    };
    assert_eq!(
        store
            .update_agent(intruder.id, agent.id, update, now())
            .await
            .expect("update"),
        None
    );
    assert!(!store
        .delete_agent(intruder.id, agent.id, operator(), now())
        .await
        .expect("delete"));

    assert_eq!(
        store.get_agent(owner.id, agent.id).await.expect("get"),
        Some(agent.clone())
    );
    assert_eq!(
        list_all(store, owner.id, &AgentFilter::default()).await,
        vec![agent]
    );
}

pub async fn list_filters(store: &DynStore) {
    let tenant = tenant(store).await;
    // Keys and values with quotes, dots and SQL/JSON-path punctuation must match literally.
    let odd_key = "we\"ird.$key' --";
    let odd_value = "it's \"quoted\"";

    let mut docker = new_agent("docker-only");
    docker.capabilities = vec![capability("docker")];
    docker.labels = labels(&[("tier", "web"), (odd_key, odd_value)]);
    let docker = register(store, tenant.id, docker).await;

    let mut both = new_agent("docker-and-ssh");
    both.capabilities = vec![capability("docker"), capability("ssh")];
    both.labels = labels(&[("tier", "db")]);
    let both = register(store, tenant.id, both).await;

    let mut bare = new_agent("bare");
    bare.capabilities = vec![];
    bare.labels = labels(&[("tier", "web")]);
    let bare = register(store, tenant.id, bare).await;

    let applied = store
        .record_heartbeats(&[heartbeat(&both, AgentStatus::Degraded, now())])
        .await
        .expect("heartbeat");
    assert_eq!(applied, vec![Applied]);
    let both = store
        .get_agent(tenant.id, both.id)
        .await
        .expect("get")
        .expect("exists");

    let ids = |agents: Vec<Agent>| agents.into_iter().map(|a| a.id).collect::<Vec<_>>();
    let filter = |status, capability: Option<&str>, label: Option<(&str, &str)>| AgentFilter {
        status,
        capability: capability.map(str::to_string),
        label: label.map(|(k, v)| (k.to_string(), v.to_string())),
    };

    let all = list_all(store, tenant.id, &AgentFilter::default()).await;
    assert_eq!(
        ids(all),
        vec![docker.id, both.id, bare.id],
        "ordered by id, i.e. creation"
    );

    let cases: Vec<(AgentFilter, Vec<AgentId>)> = vec![
        // docker and bare never heartbeated: registered, not online.
        (
            filter(Some(AgentStatus::Registered), None, None),
            vec![docker.id, bare.id],
        ),
        (filter(Some(AgentStatus::Online), None, None), vec![]),
        (
            filter(Some(AgentStatus::Degraded), None, None),
            vec![both.id],
        ),
        (filter(Some(AgentStatus::Offline), None, None), vec![]),
        (filter(None, Some("docker"), None), vec![docker.id, both.id]),
        (filter(None, Some("ssh"), None), vec![both.id]),
        (filter(None, Some("dock"), None), vec![]),
        (filter(None, Some("docker' OR '1'='1"), None), vec![]),
        (
            filter(None, None, Some(("tier", "web"))),
            vec![docker.id, bare.id],
        ),
        (filter(None, None, Some(("tier", "we"))), vec![]),
        (filter(None, None, Some(("tie", "web"))), vec![]),
        (
            filter(None, None, Some((odd_key, odd_value))),
            vec![docker.id],
        ),
        (filter(None, None, Some((odd_key, "it's"))), vec![]),
        (
            filter(None, Some("docker"), Some(("tier", "web"))),
            vec![docker.id],
        ),
        (
            filter(
                Some(AgentStatus::Online),
                Some("docker"),
                Some(("tier", "db")),
            ),
            vec![],
        ),
        (
            filter(
                Some(AgentStatus::Degraded),
                Some("ssh"),
                Some(("tier", "db")),
            ),
            vec![both.id],
        ),
    ];
    for (filter, expected) in cases {
        let got = list_all(store, tenant.id, &filter).await;
        assert_eq!(ids(got), expected, "filter {filter:?}");
    }
    let degraded = list_all(
        store,
        tenant.id,
        &filter(Some(AgentStatus::Degraded), None, None),
    )
    .await;
    assert_eq!(degraded, vec![both]);
}

pub async fn list_pagination(store: &DynStore) {
    let tenant = tenant(store).await;
    let mut expected = Vec::new();
    for i in 0..5 {
        expected.push(
            register(store, tenant.id, new_agent(&format!("page-{i}")))
                .await
                .id,
        );
    }
    let mut sorted = expected.clone();
    sorted.sort();
    assert_eq!(sorted, expected, "v7 ids are creation-ordered");

    let everything = AgentFilter::default();
    let mut seen = Vec::new();
    let mut after = None;
    let mut pages = Vec::new();
    loop {
        let page = store
            .list_agents(tenant.id, &everything, after, 2)
            .await
            .expect("list page");
        pages.push(page.items.len());
        seen.extend(page.items.iter().map(|a| a.id));
        match page.next {
            Some(next) => {
                assert_eq!(
                    Some(AgentId(next)),
                    page.items.last().map(|a| a.id),
                    "next is the last id"
                );
                after = Some(AgentId(next));
            }
            None => break,
        }
        assert!(pages.len() <= 5, "pagination terminates");
    }
    assert_eq!(seen, expected);
    assert_eq!(pages, vec![2, 2, 1]);

    // A page that ends exactly at the last row still offers `next`; the page after is empty.
    let first = store
        .list_agents(tenant.id, &everything, None, 5)
        .await
        .expect("list");
    assert_eq!(first.items.len(), 5);
    let last = store
        .list_agents(tenant.id, &everything, first.next.map(AgentId), 5)
        .await
        .expect("list");
    assert_eq!(
        last,
        crate::Page {
            items: vec![],
            next: None
        }
    );

    // `after` is exclusive and need not name a row of the page set.
    let tail = store
        .list_agents(tenant.id, &everything, Some(expected[2]), 10)
        .await
        .expect("list");
    assert_eq!(
        tail.items.iter().map(|a| a.id).collect::<Vec<_>>(),
        expected[3..].to_vec()
    );
    assert_eq!(tail.next, None);
    // A limit of 0 is treated as 1.
    let one = store
        .list_agents(tenant.id, &everything, None, 0)
        .await
        .expect("list");
    assert_eq!(one.items.len(), 1);
    assert_eq!(one.next, Some(expected[0].0));
}

pub async fn update_agent(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("mutable")).await;

    let t1 = agent.created_at + Duration::seconds(5);
    let relabelled = store
        .update_agent(
            tenant.id,
            agent.id,
            AgentUpdate {
                updated_by: None,
                labels: Some(labels(&[("zone", "a")])),
                capabilities: None,
            },
            t1,
        )
        .await
        .expect("update")
        .expect("found");
    assert_eq!(relabelled.labels, labels(&[("zone", "a")]));
    assert_eq!(
        relabelled.capabilities, agent.capabilities,
        "capabilities untouched"
    );
    assert_eq!(relabelled.updated_at, millis(t1));

    let t2 = t1 + Duration::seconds(5);
    let caps = vec![
        capability("compose"),
        Capability {
            name: "ssh".to_string(),
            version: None,
            healthy: false,
            detail: Some("no key".to_string()),
        },
    ];
    let recapped = store
        .update_agent(
            tenant.id,
            agent.id,
            AgentUpdate {
                updated_by: None,
                labels: None,
                capabilities: Some(caps.clone()),
            },
            t2,
        )
        .await
        .expect("update")
        .expect("found");
    assert_eq!(recapped.capabilities, caps);
    assert_eq!(
        recapped.labels,
        labels(&[("zone", "a")]),
        "labels untouched"
    );
    assert_eq!(recapped.updated_at, millis(t2));
    assert_eq!(
        store.get_agent(tenant.id, agent.id).await.expect("get"),
        Some(recapped.clone())
    );

    let cleared = store
        .update_agent(
            tenant.id,
            agent.id,
            AgentUpdate {
                updated_by: None,
                labels: Some(BTreeMap::new()),
                capabilities: Some(vec![]),
            },
            t2,
        )
        .await
        .expect("update")
        .expect("found");
    assert!(cleared.labels.is_empty() && cleared.capabilities.is_empty());

    let missing = store
        .update_agent(
            tenant.id,
            AgentId::new(),
            AgentUpdate {
                updated_by: None,
                labels: None,
                capabilities: None,
            },
            t2,
        )
        .await
        .expect("update");
    assert_eq!(missing, None);
}

pub async fn delete_agent(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("doomed")).await;
    let keep = register(store, tenant.id, new_agent("kept")).await;

    assert!(store
        .delete_agent(tenant.id, agent.id, operator(), now())
        .await
        .expect("delete"));
    assert!(!store
        .delete_agent(tenant.id, agent.id, operator(), now())
        .await
        .expect("delete again"));
    assert_eq!(
        store.get_agent(tenant.id, agent.id).await.expect("get"),
        None
    );
    assert_eq!(
        store
            .get_agent_for_runtime(agent.id)
            .await
            .expect("get runtime"),
        None
    );
    assert_eq!(
        list_all(store, tenant.id, &AgentFilter::default()).await,
        vec![keep]
    );

    // The binding went with the agent: its certificate no longer heartbeats anything.
    let applied = store
        .record_heartbeats(&[heartbeat(&agent, AgentStatus::Online, now())])
        .await
        .expect("heartbeat");
    assert_eq!(applied, vec![Revoked]);
    // And the name is free again.
    register(store, tenant.id, new_agent("doomed")).await;
}

pub async fn rebind_certificate(store: &DynStore) {
    use crate::RebindOutcome::{Fenced as RebindFenced, Rebound, Revoked as RebindRevoked};
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("rotating")).await;
    let other = register(store, tenant.id, new_agent("bystander")).await;
    let old = agent.certificate_fingerprint.clone().expect("bound");
    let new = fingerprint();
    let expires = now() + Duration::days(60);
    let at = now();
    let stale = session(store, &agent, at).await;
    let live = session(store, &agent, at).await;
    let rebind = |generation: i64, from: String, to: String| {
        let store = store.clone();
        async move {
            store
                .rebind_certificate(agent.id, generation, &from, &to, expires, at)
                .await
        }
    };

    assert_eq!(
        rebind(live, fingerprint(), new.clone())
            .await
            .expect("rebind"),
        RebindRevoked
    );
    assert_eq!(
        store
            .rebind_certificate(AgentId::new(), live, &old, &new, expires, at)
            .await
            .expect("rebind"),
        RebindRevoked
    );
    // A fenced process holding the bound certificate (a clone with a copied key) cannot
    // rotate the binding away from the live one.
    assert_eq!(
        rebind(stale, old.clone(), new.clone())
            .await
            .expect("rebind"),
        RebindFenced
    );
    assert_eq!(
        store
            .get_agent(tenant.id, agent.id)
            .await
            .expect("get")
            .expect("exists")
            .certificate_fingerprint,
        Some(old.clone()),
        "a fenced rebind changes nothing"
    );
    assert_eq!(
        rebind(live, old.clone(), new.clone())
            .await
            .expect("rebind"),
        Rebound
    );
    let rebound = store
        .get_agent(tenant.id, agent.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(
        rebound.certificate_fingerprint.as_deref(),
        Some(new.as_str())
    );
    assert_eq!(rebound.certificate_expires_at, Some(millis(expires)));
    assert_eq!(rebound.updated_at, millis(at));
    // The replaced certificate is remembered, so its refusal can be named as superseded.
    assert_eq!(
        rebound.previous_certificate_fingerprint.as_deref(),
        Some(old.as_str())
    );

    // The old certificate is dead at once: neither rebinding nor heartbeats accept it.
    assert_eq!(
        rebind(live, old.clone(), fingerprint())
            .await
            .expect("rebind"),
        RebindRevoked
    );
    let applied = store
        .record_heartbeats(&[heartbeat(&agent, AgentStatus::Online, now())])
        .await
        .expect("heartbeat");
    assert_eq!(applied, vec![Revoked]);

    // One certificate binds one agent.
    let theirs = other.certificate_fingerprint.clone().expect("bound");
    assert_conflict(rebind(live, new.clone(), theirs).await, "agent_certificate");

    // Only the last replaced certificate is remembered.
    let newest = fingerprint();
    assert_eq!(
        rebind(live, new.clone(), newest.clone())
            .await
            .expect("rebind"),
        Rebound
    );
    let again = store
        .get_agent_for_runtime(agent.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(again.certificate_fingerprint, Some(newest));
    assert_eq!(again.previous_certificate_fingerprint, Some(new));
}

pub async fn heartbeats(store: &DynStore) {
    assert_eq!(
        store.record_heartbeats(&[]).await.expect("empty batch"),
        Vec::<HeartbeatOutcome>::new()
    );

    let tenant = tenant(store).await;
    let live = register(store, tenant.id, new_agent("live")).await;
    let sick = register(store, tenant.id, new_agent("sick")).await;
    let gone = register(store, tenant.id, new_agent("gone")).await;
    let rotated = register(store, tenant.id, new_agent("rotated")).await;
    assert!(store
        .delete_agent(tenant.id, gone.id, operator(), now())
        .await
        .expect("delete"));
    let rotated_fp = rotated.certificate_fingerprint.clone().expect("bound");
    // Generation 0: registered, no session yet.
    assert_eq!(
        store
            .rebind_certificate(
                rotated.id,
                0,
                &rotated_fp,
                &fingerprint(),
                now() + Duration::days(30),
                now()
            )
            .await
            .expect("rebind"),
        crate::RebindOutcome::Rebound
    );

    let at = now() + Duration::seconds(1);
    let mut sick_beat = heartbeat(&sick, AgentStatus::Degraded, at);
    sick_beat.capabilities = vec![Capability {
        name: "docker".to_string(),
        version: Some("27.1".to_string()),
        healthy: false,
        detail: Some("engine not answering".to_string()),
    }];
    // Batch order is deliberately not id order: results must come back in batch order.
    let batch = vec![
        heartbeat(&rotated, AgentStatus::Online, at),
        sick_beat.clone(),
        heartbeat(&gone, AgentStatus::Online, at),
        heartbeat(&live, AgentStatus::Online, at),
    ];
    let applied = store.record_heartbeats(&batch).await.expect("heartbeats");
    assert_eq!(applied, vec![Revoked, Applied, Revoked, Applied]);

    let live_now = store
        .get_agent(tenant.id, live.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(live_now.status, AgentStatus::Online);
    assert_eq!(live_now.reported_status, AgentStatus::Online);
    assert_eq!(live_now.last_heartbeat, Some(millis(at)));
    assert_eq!(live_now.resource_usage, Some(usage()));
    assert_eq!(live_now.updated_at, millis(at));

    let sick_now = store
        .get_agent(tenant.id, sick.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(sick_now.status, AgentStatus::Degraded);
    assert_eq!(sick_now.reported_status, AgentStatus::Degraded);
    assert_eq!(sick_now.capabilities, sick_beat.capabilities);
    assert_eq!(sick_now.last_heartbeat, Some(millis(at)));

    let rotated_now = store
        .get_agent(tenant.id, rotated.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(
        rotated_now.last_heartbeat, None,
        "a stale certificate changes nothing"
    );
    assert_eq!(rotated_now.resource_usage, None);

    // A later heartbeat in the same batch wins; recovery is reported as online again.
    let later = at + Duration::seconds(30);
    let batch = vec![
        heartbeat(&sick, AgentStatus::Degraded, at),
        heartbeat(&sick, AgentStatus::Online, later),
    ];
    assert_eq!(
        store.record_heartbeats(&batch).await.expect("heartbeats"),
        vec![Applied, Applied]
    );
    let sick_now = store
        .get_agent(tenant.id, sick.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(sick_now.status, AgentStatus::Online);
    assert_eq!(sick_now.last_heartbeat, Some(millis(later)));
}

/// Uses fixed timestamps in 2001, long before anything else the suite writes, so the global
/// sweep only ever finds this case's agents and its counts stay exact on a shared database.
pub async fn sweep_stale_agents(store: &DynStore) {
    let t = datetime!(2001-01-01 00:00:00 UTC);
    let degraded_before = t;
    let offline_before = t - Duration::seconds(90);
    let tenant = tenant(store).await;

    let make = |name: &str, created_at: OffsetDateTime| {
        let mut agent = new_agent(name);
        agent.created_at = created_at;
        agent
    };
    let old = t - Duration::seconds(200);
    let mut agents = BTreeMap::new();
    for (name, created_at) in [
        ("fresh", old),
        ("late", old),
        ("late-reported-degraded", old),
        ("gone", old),
        ("silent-old", old),
        // Registered between the two cut-offs, never heartbeated: late for `degraded`, not
        // yet for `offline`; a registered agent is never made degraded.
        ("silent-mid", t - Duration::seconds(60)),
        ("silent-new", t + Duration::seconds(5)),
        ("already-offline", old),
    ] {
        agents.insert(
            name,
            register(store, tenant.id, make(name, created_at)).await,
        );
    }
    let beats = [
        ("fresh", AgentStatus::Online, t + Duration::seconds(1)),
        ("late", AgentStatus::Online, t - Duration::seconds(60)),
        (
            "late-reported-degraded",
            AgentStatus::Degraded,
            t - Duration::seconds(60),
        ),
        ("gone", AgentStatus::Online, t - Duration::seconds(120)),
        (
            "already-offline",
            AgentStatus::Offline,
            t - Duration::seconds(120),
        ),
    ];
    let batch: Vec<_> = beats
        .iter()
        .map(|(name, status, at)| heartbeat(&agents[name], *status, *at))
        .collect();
    assert!(store
        .record_heartbeats(&batch)
        .await
        .expect("heartbeats")
        .iter()
        .all(|a| *a == Applied));

    let swept = store
        .sweep_stale_agents(degraded_before, offline_before)
        .await
        .expect("sweep");
    assert_eq!(
        swept,
        StaleSweep {
            degraded: 1,
            offline: 2
        }
    );

    let expected = [
        ("fresh", AgentStatus::Online, AgentStatus::Online),
        ("late", AgentStatus::Degraded, AgentStatus::Online),
        (
            "late-reported-degraded",
            AgentStatus::Degraded,
            AgentStatus::Degraded,
        ),
        ("gone", AgentStatus::Offline, AgentStatus::Online),
        ("silent-old", AgentStatus::Offline, AgentStatus::Registered),
        (
            "silent-mid",
            AgentStatus::Registered,
            AgentStatus::Registered,
        ),
        (
            "silent-new",
            AgentStatus::Registered,
            AgentStatus::Registered,
        ),
        (
            "already-offline",
            AgentStatus::Offline,
            AgentStatus::Offline,
        ),
    ];
    for (name, status, reported) in expected {
        let agent = store
            .get_agent(tenant.id, agents[name].id)
            .await
            .expect("get")
            .expect("exists");
        assert_eq!(
            (agent.status, agent.reported_status),
            (status, reported),
            "agent {name}"
        );
    }

    let again = store
        .sweep_stale_agents(degraded_before, offline_before)
        .await
        .expect("sweep");
    assert_eq!(
        again,
        StaleSweep::default(),
        "only rows that change are counted"
    );

    // A heartbeat brings a swept agent back.
    let back = heartbeat(
        &agents["gone"],
        AgentStatus::Online,
        t + Duration::seconds(2),
    );
    assert_eq!(
        store.record_heartbeats(&[back]).await.expect("heartbeat"),
        vec![Applied]
    );
    let gone = store
        .get_agent(tenant.id, agents["gone"].id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(gone.status, AgentStatus::Online);
}

pub async fn session_lease(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("sessions")).await;
    let fp = bound(&agent);
    let t = now();
    let ttl = Duration::seconds(30);

    let first = store
        .acquire_session(agent.id, &fp, "instance-a", None, t, t + ttl)
        .await
        .expect("acquire");
    assert_eq!(
        first,
        SessionOutcome::Acquired {
            generation: 1,
            lease_expires_at: millis(t + ttl)
        }
    );
    // A second live process with the same identity is refused and told who holds it.
    let held = store
        .acquire_session(
            agent.id,
            &fp,
            "instance-b",
            None,
            t + Duration::seconds(1),
            t + ttl,
        )
        .await
        .expect("acquire");
    assert_eq!(
        held,
        SessionOutcome::Held {
            holder_instance: "instance-a".to_string(),
            lease_expires_at: millis(t + ttl)
        }
    );
    // The holder itself may re-acquire (a restart of the same instance): a new generation.
    let again = store
        .acquire_session(
            agent.id,
            &fp,
            "instance-a",
            None,
            t + Duration::seconds(2),
            t + Duration::seconds(40),
        )
        .await
        .expect("acquire");
    assert_eq!(
        again,
        SessionOutcome::Acquired {
            generation: 2,
            lease_expires_at: millis(t + Duration::seconds(40))
        }
    );
    // The agent's row says which generation it holds (the API's `sessionGeneration`).
    let row = store.get_agent(tenant.id, agent.id).await.expect("get");
    assert_eq!(row.map(|a| a.generation), Some(2));
    // Expired (the lease ends at its instant): anyone takes it over.
    let takeover = store
        .acquire_session(
            agent.id,
            &fp,
            "instance-b",
            None,
            t + Duration::seconds(40),
            t + Duration::seconds(70),
        )
        .await
        .expect("acquire");
    assert_eq!(
        takeover,
        SessionOutcome::Acquired {
            generation: 3,
            lease_expires_at: millis(t + Duration::seconds(70))
        }
    );

    // Release: only with the current generation; then the lease is free at once.
    assert!(!store
        .release_session(agent.id, 2, t)
        .await
        .expect("release"));
    assert!(store
        .release_session(agent.id, 3, t)
        .await
        .expect("release"));
    assert!(!store
        .release_session(agent.id, 3, t)
        .await
        .expect("release twice"));
    let after_release = store
        .acquire_session(
            agent.id,
            &fp,
            "instance-c",
            None,
            t + Duration::seconds(41),
            t + Duration::seconds(71),
        )
        .await
        .expect("acquire");
    assert!(matches!(
        after_release,
        SessionOutcome::Acquired { generation: 4, .. }
    ));

    // A certificate that is not the binding, an unknown or a deleted agent: revoked.
    assert_eq!(
        store
            .acquire_session(agent.id, &fingerprint(), "instance-a", None, t, t + ttl)
            .await
            .expect("acquire"),
        SessionOutcome::Revoked
    );
    assert_eq!(
        store
            .acquire_session(AgentId::new(), &fp, "instance-a", None, t, t + ttl)
            .await
            .expect("acquire"),
        SessionOutcome::Revoked
    );
    let doomed = register(store, tenant.id, new_agent("doomed-session")).await;
    assert!(store
        .delete_agent(tenant.id, doomed.id, operator(), now())
        .await
        .expect("delete"));
    assert_eq!(
        store
            .acquire_session(doomed.id, &bound(&doomed), "instance-a", None, t, t + ttl)
            .await
            .expect("acquire"),
        SessionOutcome::Revoked
    );
}

/// A restart of the same installation takes a live lease at once: the contender presents the
/// restart key its dead predecessor recorded. Another key, none, or a holder that recorded none
/// is refused while the lease lives; the holder's key is replaced with each acquisition.
pub async fn session_restart_takeover(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("phoenix")).await;
    let fp = bound(&agent);
    let t = now();
    let at = |s: i64| t + Duration::seconds(s);
    let acquire = |instance: &'static str, key: Option<&'static str>, s: i64| {
        let fp = fp.clone();
        async move {
            store
                .acquire_session(agent.id, &fp, instance, key, at(s), at(s + 30))
                .await
                .expect("acquire")
        }
    };
    let generation = |outcome: SessionOutcome| match outcome {
        SessionOutcome::Acquired { generation, .. } => generation,
        other => panic!("expected the session, got {other:?}"),
    };
    let held_by = |outcome: SessionOutcome| match outcome {
        SessionOutcome::Held {
            holder_instance, ..
        } => holder_instance,
        other => panic!("expected SESSION_HELD, got {other:?}"),
    };

    assert_eq!(generation(acquire("p1", Some("boot-a/lock-1"), 0).await), 1);
    // Another host (boot), another installation (lock), or no proof: held.
    assert_eq!(
        held_by(acquire("clone", Some("boot-b/lock-1"), 1).await),
        "p1"
    );
    assert_eq!(
        held_by(acquire("clone", Some("boot-a/lock-2"), 1).await),
        "p1"
    );
    assert_eq!(held_by(acquire("second", None, 1).await), "p1");
    store
        .mark_agent_degraded(agent.id, at(60))
        .await
        .expect("mark degraded");
    // The restart on the same boot with the same lock: at once, a new generation, and the
    // degraded mark is cleared.
    assert_eq!(generation(acquire("p2", Some("boot-a/lock-1"), 2).await), 2);
    let record = HeartbeatRecord {
        generation: 2,
        ..heartbeat(&agent, AgentStatus::Online, at(3))
    };
    assert_eq!(
        store.record_heartbeats(&[record]).await.expect("heartbeat"),
        vec![HeartbeatOutcome::Applied]
    );
    let read = store
        .get_agent(tenant.id, agent.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(read.status, AgentStatus::Online);
    // Again and again: every restart records the key anew.
    assert_eq!(generation(acquire("p3", Some("boot-a/lock-1"), 4).await), 3);
    assert_eq!(
        held_by(acquire("clone", Some("boot-b/lock-1"), 5).await),
        "p3"
    );
    // A holder that proved nothing cannot be taken over early, whatever the contender claims.
    assert_eq!(generation(acquire("p4", None, 40).await), 4);
    assert_eq!(
        held_by(acquire("p5", Some("boot-a/lock-1"), 41).await),
        "p4"
    );
    // After the lease ends anyone takes it, as before.
    assert_eq!(
        generation(acquire("p5", Some("boot-a/lock-1"), 70).await),
        5
    );
}

/// A refused second process marks the agent degraded for a while: the holder's heartbeats in
/// that window record what it reports but leave the status degraded; after it, or after a
/// takeover, heartbeats set the status again.
pub async fn session_conflict_degrades(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("cloned")).await;
    let t = now();
    let generation = session(store, &agent, t).await;
    let status = |a: &Agent| (a.status, a.reported_status);
    let read = || async {
        store
            .get_agent(tenant.id, agent.id)
            .await
            .expect("get")
            .expect("exists")
    };
    let beat = |at: OffsetDateTime| {
        let record = HeartbeatRecord {
            generation,
            ..heartbeat(&agent, AgentStatus::Online, at)
        };
        async move { store.record_heartbeats(&[record]).await.expect("heartbeat") }
    };

    store
        .mark_agent_degraded(agent.id, t + Duration::seconds(90))
        .await
        .expect("mark degraded");
    assert_eq!(
        status(&read().await),
        (AgentStatus::Degraded, AgentStatus::Registered)
    );
    assert_eq!(
        beat(t + Duration::seconds(30)).await,
        vec![HeartbeatOutcome::Applied]
    );
    let during = read().await;
    assert_eq!(
        status(&during),
        (AgentStatus::Degraded, AgentStatus::Online)
    );
    assert_eq!(
        during.last_heartbeat,
        Some(millis(t + Duration::seconds(30)))
    );
    // The window has passed: the holder's report stands again.
    beat(t + Duration::seconds(91)).await;
    assert_eq!(
        status(&read().await),
        (AgentStatus::Online, AgentStatus::Online)
    );

    // A takeover ends the conflict at once.
    store
        .mark_agent_degraded(agent.id, t + Duration::seconds(300))
        .await
        .expect("mark degraded");
    let taken = match store
        .acquire_session(
            agent.id,
            &bound(&agent),
            "instance-clone",
            None,
            t + Duration::seconds(200),
            t + Duration::seconds(230),
        )
        .await
        .expect("acquire")
    {
        SessionOutcome::Acquired { generation, .. } => generation,
        other => panic!("takeover refused: {other:?}"),
    };
    let record = HeartbeatRecord {
        generation: taken,
        ..heartbeat(&agent, AgentStatus::Online, t + Duration::seconds(201))
    };
    store.record_heartbeats(&[record]).await.expect("heartbeat");
    assert_eq!(
        status(&read().await),
        (AgentStatus::Online, AgentStatus::Online)
    );
}

/// The version an agent process says it runs with its session replaces the registered one,
/// for the current generation only.
pub async fn session_records_version(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("upgraded")).await;
    assert_eq!(agent.version, "0.1.0");
    let t = now();
    let first = session(store, &agent, t).await;
    let read = || async {
        store
            .get_agent(tenant.id, agent.id)
            .await
            .expect("get")
            .expect("exists")
    };
    assert!(store
        .record_agent_version(agent.id, first, "0.2.0")
        .await
        .expect("record version"));
    let upgraded = read().await;
    assert_eq!(upgraded.version, "0.2.0");
    assert_eq!(upgraded.updated_at, agent.updated_at, "not an edit");
    assert!(!store
        .record_agent_version(agent.id, first, "0.2.0")
        .await
        .expect("record the same version"));

    // A process whose session was taken over records nothing.
    let second = session(store, &agent, t + Duration::seconds(1)).await;
    assert!(second > first);
    assert!(!store
        .record_agent_version(agent.id, first, "0.1.0")
        .await
        .expect("record version"));
    assert_eq!(read().await.version, "0.2.0");
    assert!(!store
        .record_agent_version(AgentId::new(), second, "0.1.0")
        .await
        .expect("record version for nobody"));
}

pub async fn heartbeat_fencing(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("fenced")).await;
    let t = now();
    let generation = session(store, &agent, t).await;
    assert_eq!(generation, 1);

    let mut stale = heartbeat(&agent, AgentStatus::Online, t + Duration::seconds(1));
    stale.generation = 0;
    let mut current = heartbeat(&agent, AgentStatus::Degraded, t + Duration::seconds(2));
    current.generation = generation;
    current.session_expires_at = t + Duration::seconds(300);
    let mut rotated = current.clone();
    rotated.certificate_fingerprint = fingerprint();
    assert_eq!(
        store
            .record_heartbeats(&[stale, rotated, current])
            .await
            .expect("heartbeats"),
        vec![Fenced, Revoked, Applied]
    );
    let read = store
        .get_agent(tenant.id, agent.id)
        .await
        .expect("get")
        .expect("exists");
    assert_eq!(read.reported_status, AgentStatus::Degraded);
    assert_eq!(read.last_heartbeat, Some(millis(t + Duration::seconds(2))));

    // The heartbeat renewed the lease: another instance is held off until the new expiry.
    let probe = store
        .acquire_session(
            agent.id,
            &bound(&agent),
            "intruder",
            None,
            t + Duration::seconds(60),
            t + Duration::seconds(90),
        )
        .await
        .expect("acquire");
    assert!(
        matches!(probe, SessionOutcome::Held { lease_expires_at, .. } if lease_expires_at == millis(t + Duration::seconds(300))),
        "{probe:?}"
    );
}

/// A heartbeat applies only with a sequence above the last one applied in its generation; a
/// refused one changes nothing, and of two concurrent heartbeats with one sequence exactly one
/// applies. A new generation starts afresh; a stale one is fenced, whatever its sequence.
pub async fn heartbeat_replay(store: &DynStore) {
    let tenant = tenant(store).await;
    let agent = register(store, tenant.id, new_agent("replayed")).await;
    let t = now();
    let generation = session(store, &agent, t).await;
    let beat = |sequence: i64, status: AgentStatus, at: OffsetDateTime| HeartbeatRecord {
        generation,
        sequence,
        ..heartbeat(&agent, status, at)
    };
    let read = || async {
        store
            .get_agent(tenant.id, agent.id)
            .await
            .expect("get")
            .expect("exists")
    };
    let state = |a: &Agent| {
        (
            a.status,
            a.reported_status,
            a.last_heartbeat,
            a.resource_usage.clone(),
            a.capabilities.clone(),
            a.updated_at,
        )
    };

    let applied = beat(5, AgentStatus::Online, t + Duration::seconds(1));
    assert_eq!(
        store
            .record_heartbeats(&[applied])
            .await
            .expect("heartbeat"),
        vec![Applied]
    );
    let before = state(&read().await);
    assert_eq!(before.2, Some(millis(t + Duration::seconds(1))));

    // The same sequence again, and a lower one, each trying to change everything.
    for sequence in [5, 4, 0] {
        let mut replay = beat(sequence, AgentStatus::Degraded, t + Duration::seconds(2));
        replay.capabilities = vec![capability("ssh")];
        replay.resource_usage.cpu_percent = 99.0;
        replay.session_expires_at = t + Duration::hours(1);
        assert_eq!(
            store.record_heartbeats(&[replay]).await.expect("heartbeat"),
            vec![Replayed],
            "sequence {sequence}"
        );
        assert_eq!(state(&read().await), before, "a replay changed the agent");
    }

    // Within one batch: the first of two with one sequence applies, the second is a replay.
    let at = t + Duration::seconds(3);
    assert_eq!(
        store
            .record_heartbeats(&[
                beat(6, AgentStatus::Degraded, at),
                beat(6, AgentStatus::Online, at + Duration::seconds(1)),
            ])
            .await
            .expect("heartbeats"),
        vec![Applied, Replayed]
    );
    let read_now = read().await;
    assert_eq!(read_now.reported_status, AgentStatus::Degraded);
    assert_eq!(read_now.last_heartbeat, Some(millis(at)));

    // Concurrent transactions with one sequence: exactly one applies, every round.
    for round in 0..10i64 {
        let sequence = 100 + round;
        let at = t + Duration::seconds(10 + round);
        let (a, b) = (
            [beat(sequence, AgentStatus::Online, at)],
            [beat(sequence, AgentStatus::Degraded, at)],
        );
        let (a, b) = tokio::join!(store.record_heartbeats(&a), store.record_heartbeats(&b));
        let mut outcomes = vec![a.expect("heartbeat")[0], b.expect("heartbeat")[0]];
        outcomes.sort_by_key(|o| *o != Applied);
        assert_eq!(outcomes, vec![Applied, Replayed], "round {round}");
    }

    // A new generation starts afresh; the old one is fenced even with a higher sequence.
    let later = t + Duration::hours(2);
    let next = session(store, &agent, later).await;
    assert!(next > generation);
    let fresh = HeartbeatRecord {
        generation: next,
        sequence: 1,
        ..heartbeat(&agent, AgentStatus::Online, later + Duration::seconds(1))
    };
    let stale = beat(1_000, AgentStatus::Degraded, later + Duration::seconds(2));
    assert_eq!(
        store
            .record_heartbeats(&[fresh, stale])
            .await
            .expect("heartbeats"),
        vec![Applied, Fenced]
    );
    let read_now = read().await;
    assert_eq!(read_now.reported_status, AgentStatus::Online);
    assert_eq!(
        read_now.last_heartbeat,
        Some(millis(later + Duration::seconds(1)))
    );
}

/// Cordon and suspend (issue 14 item 4): each hold is audited once, written as an `agent.hold`
/// event, idempotent, and enforced where work enters the agent's queue (cordon) or leaves it
/// (suspend). A read-back passes a cordon; a suspended agent keeps its heartbeats.
pub async fn agent_holds(store: &DynStore) {
    use crate::{AgentHold, EventFilter};
    use berth_proto::audit::actions::{AGENT_CORDON, AGENT_RESUME, AGENT_SUSPEND, AGENT_UNCORDON};
    let tenant = tenant(store).await;
    let other = self::tenant(store).await;
    let agent = register(store, tenant.id, new_agent("held")).await;
    let t = now();
    let generation = session(store, &agent, t).await;
    let hold = |h: AgentHold| {
        let store = store.clone();
        async move {
            store
                .set_agent_hold(tenant.id, agent.id, h, operator(), now())
                .await
                .expect("set hold")
                .expect("the agent exists")
        }
    };
    let audited = |action: &'static str| {
        let store = store.clone();
        async move {
            store
                .list_audit(tenant.id, 0, 1000)
                .await
                .expect("list audit")
                .iter()
                .filter(|e| e.action == action && e.subject == agent.id.to_string())
                .count()
        }
    };

    // Another tenant's token cannot hold it; an unknown agent is None.
    assert_eq!(
        store
            .set_agent_hold(other.id, agent.id, AgentHold::Cordon, operator(), t)
            .await
            .expect("set hold"),
        None
    );
    assert!(
        !store
            .get_agent(tenant.id, agent.id)
            .await
            .unwrap()
            .unwrap()
            .cordoned
    );

    // Cordon: creates refused, read-backs admitted, queued work still claimable.
    let queued = create(store, new_task(tenant.id, agent.id, t)).await;
    let cordoned = hold(AgentHold::Cordon).await;
    assert!(cordoned.cordoned && !cordoned.suspended);
    hold(AgentHold::Cordon).await;
    assert_eq!(
        audited(AGENT_CORDON).await,
        1,
        "a repeated cordon is not audited again"
    );
    assert_eq!(
        store
            .create_task(new_task(tenant.id, agent.id, t))
            .await
            .expect("create"),
        CreateTaskOutcome::AgentCordoned
    );
    let read_back = NewTask {
        read_back_of: Some(queued.id),
        priority: i32::MAX,
        ..new_task(tenant.id, agent.id, t)
    };
    let read_back = create(store, read_back).await;
    let (first, _) = claimed(store, &agent, generation, now()).await;
    assert_eq!(
        first.id, read_back.id,
        "a cordoned agent still runs its queue"
    );
    let uncordoned = hold(AgentHold::Uncordon).await;
    assert!(!uncordoned.cordoned);
    assert_eq!(audited(AGENT_UNCORDON).await, 1);
    let after = create(store, new_task(tenant.id, agent.id, t)).await;

    // Suspend: nothing is claimed, status filters say blocked, heartbeats still apply.
    let suspended = hold(AgentHold::Suspend).await;
    assert!(suspended.suspended);
    assert_eq!(audited(AGENT_SUSPEND).await, 1);
    assert_eq!(
        claim(store, &agent, generation, now()).await,
        ClaimOutcome::Empty
    );
    let mut beat = heartbeat(&agent, AgentStatus::Online, now());
    beat.generation = generation;
    beat.sequence = 1;
    assert_eq!(
        store.record_heartbeats(&[beat]).await.expect("heartbeat"),
        vec![HeartbeatOutcome::Applied],
        "a suspended agent keeps its session"
    );
    let blocked = AgentFilter {
        status: Some(AgentStatus::Blocked),
        ..AgentFilter::default()
    };
    let online = AgentFilter {
        status: Some(AgentStatus::Online),
        ..AgentFilter::default()
    };
    assert_eq!(
        list_all(store, tenant.id, &blocked)
            .await
            .iter()
            .map(|a| a.id)
            .collect::<Vec<_>>(),
        vec![agent.id]
    );
    assert!(list_all(store, tenant.id, &online).await.is_empty());
    let resumed = hold(AgentHold::Resume).await;
    assert!(!resumed.suspended);
    assert_eq!(audited(AGENT_RESUME).await, 1);
    assert_eq!(
        list_all(store, tenant.id, &online)
            .await
            .iter()
            .map(|a| a.id)
            .collect::<Vec<_>>(),
        vec![agent.id]
    );
    let (next, _) = claimed(store, &agent, generation, now()).await;
    assert_eq!(next.id, queued.id);
    assert_ne!(next.id, after.id);

    // Each change is one `agent.hold` event carrying both holds.
    let events = store
        .read_events(tenant.id, &EventFilter::default(), 0, 1000)
        .await
        .expect("events");
    let holds: Vec<(bool, bool)> = events
        .iter()
        .filter(|e| e.kind == berth_proto::event::AGENT_HOLD)
        .map(|e| {
            (
                e.data["cordoned"].as_bool().expect("cordoned"),
                e.data["suspended"].as_bool().expect("suspended"),
            )
        })
        .collect();
    assert_eq!(
        holds,
        vec![(true, false), (false, false), (false, true), (false, false)]
    );
}
