//! Conformance cases of reconciler claims: one holder at a time, a holder renewing its own
//! claim, a release only by the holder, a dead holder's claim taken once its lease ran out (by
//! the database's clock), a batch taking only what is free, one winner among concurrent
//! claimants, and the database's now.

use super::*;

fn unit() -> String {
    format!("unit-{}", uuid::Uuid::new_v4())
}

/// Claims `units` as `holder` for a minute: those taken.
async fn claim(store: &DynStore, reconciler: &str, units: &[&String], holder: &str) -> Vec<String> {
    let units: Vec<String> = units.iter().map(|u| u.to_string()).collect();
    store
        .claim_units(
            reconciler,
            &units,
            holder,
            std::time::Duration::from_secs(60),
        )
        .await
        .expect("claim")
}

async fn release(store: &DynStore, reconciler: &str, units: &[&String], holder: &str) -> u64 {
    let units: Vec<String> = units.iter().map(|u| u.to_string()).collect();
    store
        .release_units(reconciler, &units, holder)
        .await
        .expect("release")
}

pub async fn reconciler_claims(store: &DynStore) {
    let now = store.database_now().await.expect("database now");
    let drift = (now - OffsetDateTime::now_utc()).abs();
    assert!(drift < Duration::minutes(5), "database clock {now}");
    assert_eq!(now, millis(now), "millisecond precision");
    assert!(store
        .claim_units("drift", &[], "a", std::time::Duration::from_secs(1))
        .await
        .expect("an empty batch")
        .is_empty());

    let u = unit();
    assert_eq!(claim(store, "drift", &[&u], "a").await, vec![u.clone()]);
    assert!(
        claim(store, "drift", &[&u], "b").await.is_empty(),
        "a live claim is not taken by another holder"
    );
    assert_eq!(
        claim(store, "other", &[&u], "b").await,
        vec![u.clone()],
        "claims are per reconciler"
    );
    assert_eq!(
        claim(store, "drift", &[&u], "a").await,
        vec![u.clone()],
        "the holder renews its own claim"
    );
    assert_eq!(
        release(store, "drift", &[&u], "b").await,
        0,
        "only the holder lets go"
    );
    assert!(claim(store, "drift", &[&u], "b").await.is_empty());
    assert_eq!(release(store, "drift", &[&u], "a").await, 1);
    assert_eq!(release(store, "drift", &[&u], "a").await, 0);
    assert_eq!(claim(store, "drift", &[&u], "b").await, vec![u.clone()]);

    // A batch takes what is free (and its own), sorted, and skips what another holds; a unit
    // named twice is claimed once.
    let (x, y) = (unit(), unit());
    let mut expected = vec![x.clone(), y.clone()];
    expected.sort();
    assert_eq!(
        claim(store, "drift", &[&y, &u, &x, &y], "c").await,
        expected,
        "b holds {u}"
    );
    assert_eq!(release(store, "drift", &[&u, &x, &y], "c").await, 2);

    // A holder that dies keeps its claim only until the lease runs out.
    let dead = unit();
    let zero = std::time::Duration::ZERO;
    let batch = [dead.clone()];
    assert_eq!(
        store
            .claim_units("drift", &batch, "dead", zero)
            .await
            .unwrap(),
        batch
    );
    assert_eq!(
        claim(store, "drift", &[&dead], "c").await,
        batch,
        "an expired claim is taken"
    );
    assert_eq!(
        release(store, "drift", &[&dead], "dead").await,
        0,
        "the old holder no longer holds it"
    );
    assert!(claim(store, "drift", &[&dead], "dead").await.is_empty());

    // Concurrent claimants of overlapping batches: each unit has exactly one winner.
    let contested: Vec<String> = (0..5).map(|_| unit()).collect();
    let mut racers = Vec::new();
    for i in 0..8usize {
        let store = store.clone();
        // Each racer names the units in another order.
        let mut mine = contested.clone();
        mine.rotate_left(i % contested.len());
        racers.push(tokio::spawn(async move {
            store
                .claim_units(
                    "race",
                    &mine,
                    &format!("holder-{i}"),
                    std::time::Duration::from_secs(60),
                )
                .await
                .expect("claim")
        }));
    }
    let mut won = Vec::new();
    for racer in racers {
        won.extend(racer.await.expect("racer"));
    }
    won.sort();
    let mut expected = contested.clone();
    expected.sort();
    assert_eq!(won, expected, "every unit won by one claimant of eight");
}
