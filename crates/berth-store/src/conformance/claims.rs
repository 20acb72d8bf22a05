//! Conformance cases of reconciler claims: one holder at a time, a holder renewing its own
//! claim, a release only by the holder, a dead holder's claim taken once its lease ran out (by
//! the database's clock), one winner among concurrent claimants, and the database's now.

use super::*;

fn unit() -> String {
    format!("unit-{}", uuid::Uuid::new_v4())
}

pub async fn reconciler_claims(store: &DynStore) {
    let lease = std::time::Duration::from_secs(60);
    let now = store.database_now().await.expect("database now");
    let drift = (now - OffsetDateTime::now_utc()).abs();
    assert!(drift < Duration::minutes(5), "database clock {now}");
    assert_eq!(now, millis(now), "millisecond precision");

    let unit = unit();
    assert!(store.claim_unit("drift", &unit, "a", lease).await.unwrap());
    assert!(
        !store.claim_unit("drift", &unit, "b", lease).await.unwrap(),
        "a live claim is not taken by another holder"
    );
    assert!(
        store.claim_unit("other", &unit, "b", lease).await.unwrap(),
        "claims are per reconciler"
    );
    assert!(
        store.claim_unit("drift", &unit, "a", lease).await.unwrap(),
        "the holder renews its own claim"
    );
    assert!(
        !store.release_unit("drift", &unit, "b").await.unwrap(),
        "only the holder lets go"
    );
    assert!(!store.claim_unit("drift", &unit, "b", lease).await.unwrap());
    assert!(store.release_unit("drift", &unit, "a").await.unwrap());
    assert!(!store.release_unit("drift", &unit, "a").await.unwrap());
    assert!(store.claim_unit("drift", &unit, "b", lease).await.unwrap());

    // A holder that dies keeps its claim only until the lease runs out.
    let dead = self::unit();
    let zero = std::time::Duration::ZERO;
    assert!(store
        .claim_unit("drift", &dead, "dead", zero)
        .await
        .unwrap());
    assert!(
        store.claim_unit("drift", &dead, "c", lease).await.unwrap(),
        "an expired claim is taken"
    );
    assert!(
        !store.release_unit("drift", &dead, "dead").await.unwrap(),
        "the old holder no longer holds it"
    );
    assert!(!store
        .claim_unit("drift", &dead, "dead", lease)
        .await
        .unwrap());

    // Concurrent claimants: exactly one wins.
    let contested = self::unit();
    let mut racers = Vec::new();
    for i in 0..8 {
        let (store, contested) = (store.clone(), contested.clone());
        racers.push(tokio::spawn(async move {
            store
                .claim_unit("race", &contested, &format!("holder-{i}"), lease)
                .await
                .expect("claim")
        }));
    }
    let mut won = 0;
    for racer in racers {
        won += usize::from(racer.await.expect("racer"));
    }
    assert_eq!(won, 1, "one claimant of eight wins");
}
