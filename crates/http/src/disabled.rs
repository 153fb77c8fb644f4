//! Which destinations are disabled, as this instance knows it: a copy of the store's list
//! ([`Store::disabled_destinations`]) that the delivery worker reads for every delivery, the
//! admin API changes, and a gateway on a shared store reloads every few seconds.
//!
//! The rule that keeps an enabled destination's deliveries from waiting: this copy forgets a
//! destination *before* the store enables it, and a worker that put a delivery back because
//! its destination was disabled looks again once the put-back is committed, waking the
//! destination if it is enabled by then. Whichever of the enable and the put-back commits
//! second moves the row: the enable's wake if the put-back came first, the worker's if it came
//! second (the copy was already changed when the enable began).

use std::collections::BTreeMap;
use std::sync::RwLock;

use hooklatch_core::store::DisabledDestination;
use hooklatch_core::{Store, StoreError, Timestamp};

/// What a [`DisabledDestinations::reload`] changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reloaded {
    /// Disabled before, enabled now.
    pub enabled: Vec<String>,
    /// Newly disabled.
    pub disabled: Vec<DisabledDestination>,
}

/// This instance's copy of the disabled destinations.
#[derive(Default)]
pub struct DisabledDestinations {
    by_name: RwLock<BTreeMap<String, DisabledDestination>>,
}

impl DisabledDestinations {
    /// Whether `destination` is disabled.
    pub fn is_disabled(&self, destination: &str) -> bool {
        let map = self.by_name.read().expect("disabled destinations lock");
        !map.is_empty() && map.contains_key(destination)
    }

    /// Whether any destination is disabled.
    pub fn any(&self) -> bool {
        !self
            .by_name
            .read()
            .expect("disabled destinations lock")
            .is_empty()
    }

    /// Why `destination` is disabled, if it is.
    pub fn get(&self, destination: &str) -> Option<DisabledDestination> {
        self.by_name
            .read()
            .expect("disabled destinations lock")
            .get(destination)
            .cloned()
    }

    /// Every disabled destination, by name.
    pub fn all(&self) -> Vec<DisabledDestination> {
        self.by_name
            .read()
            .expect("disabled destinations lock")
            .values()
            .cloned()
            .collect()
    }

    /// Replaces the copy with the store's list; returns what changed: the destinations the
    /// store no longer has disabled (enabled by another instance, for the caller to wake), and
    /// the ones it newly has.
    pub async fn reload(&self, store: &dyn Store) -> Result<Reloaded, StoreError> {
        let fresh: BTreeMap<String, DisabledDestination> = store
            .disabled_destinations()
            .await?
            .into_iter()
            .map(|d| (d.destination.clone(), d))
            .collect();
        let mut map = self.by_name.write().expect("disabled destinations lock");
        let enabled = map
            .keys()
            .filter(|name| !fresh.contains_key(*name))
            .cloned()
            .collect();
        let disabled = fresh
            .values()
            .filter(|d| !map.contains_key(&d.destination))
            .cloned()
            .collect();
        *map = fresh;
        Ok(Reloaded { enabled, disabled })
    }

    /// Disables a destination here at once and in the store. Returns whether the store had it
    /// enabled. When the store cannot be written, this instance holds the destination's
    /// deliveries all the same (the error is returned): a destination that answered `410 Gone`
    /// is not sent to again from here.
    pub async fn disable(
        &self,
        store: &dyn Store,
        disabled: DisabledDestination,
    ) -> Result<bool, StoreError> {
        self.by_name
            .write()
            .expect("disabled destinations lock")
            .entry(disabled.destination.clone())
            .or_insert_with(|| disabled.clone());
        let added = store.disable_destination(disabled.clone()).await?;
        if !added {
            // Disabled already, perhaps by another instance, with the reason it gave first.
            if let Some(first) = store
                .disabled_destinations()
                .await?
                .into_iter()
                .find(|d| d.destination == disabled.destination)
            {
                self.by_name
                    .write()
                    .expect("disabled destinations lock")
                    .insert(first.destination.clone(), first);
            }
        }
        Ok(added)
    }

    /// Enables a destination: forgets it here first, then enables it in the store, which wakes
    /// its waiting deliveries. Returns the rows woken, or `None` when the store did not have it
    /// disabled. On an error the copy is reloaded from the store.
    pub async fn enable(
        &self,
        store: &dyn Store,
        destination: &str,
        now: Timestamp,
    ) -> Result<Option<u64>, StoreError> {
        self.by_name
            .write()
            .expect("disabled destinations lock")
            .remove(destination);
        match store.enable_destination(destination, now).await {
            Ok(woken) => Ok(woken),
            Err(err) => {
                let _ = self.reload(store).await;
                Err(err)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use hooklatch_testkit::MemoryStore;

    use super::*;

    fn gone(name: &str, at: i64) -> DisabledDestination {
        DisabledDestination {
            destination: name.to_owned(),
            disabled_at: Timestamp(at),
            reason: format!("gone at {at}"),
        }
    }

    #[tokio::test]
    async fn a_second_disable_keeps_the_first_reason_here_as_in_the_store() {
        let store = MemoryStore::default();
        let copy = DisabledDestinations::default();
        assert!(copy.disable(&store, gone("app", 1)).await.unwrap());
        let other = DisabledDestinations::default();
        assert!(!other.disable(&store, gone("app", 2)).await.unwrap());
        assert_eq!(other.get("app"), Some(gone("app", 1)));
        assert!(copy.is_disabled("app") && !copy.is_disabled("audit"));
    }

    #[tokio::test]
    async fn a_reload_names_what_another_instance_enabled() {
        let store = MemoryStore::default();
        let here = DisabledDestinations::default();
        let there = DisabledDestinations::default();
        here.disable(&store, gone("app", 1)).await.unwrap();
        here.disable(&store, gone("audit", 1)).await.unwrap();
        let loaded = there.reload(&store).await.unwrap();
        assert_eq!(loaded.enabled, Vec::<String>::new());
        assert_eq!(loaded.disabled, vec![gone("app", 1), gone("audit", 1)]);
        assert_eq!(there.all().len(), 2);
        assert_eq!(
            there.enable(&store, "app", Timestamp(5)).await.unwrap(),
            Some(0)
        );
        assert!(!there.is_disabled("app"));
        assert_eq!(
            here.reload(&store).await.unwrap(),
            Reloaded {
                enabled: vec!["app".to_owned()],
                disabled: Vec::new(),
            }
        );
        assert!(!here.is_disabled("app") && here.is_disabled("audit"));
        assert_eq!(
            here.enable(&store, "app", Timestamp(6)).await.unwrap(),
            None,
            "enabled already"
        );
    }
}
