//! A metrics recorder for unit tests: keeps every histogram value recorded through it, so a
//! test can read what an operator's dashboard would show.

use std::sync::{Arc, Mutex};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, SharedString, Unit};

/// A recorder keeping every histogram value recorded through it, with its metric's name
/// (for `metrics::with_local_recorder`).
#[derive(Default)]
pub(crate) struct Histograms(Arc<Mutex<Vec<(String, f64)>>>);

struct Values {
    name: String,
    into: Arc<Mutex<Vec<(String, f64)>>>,
}

impl metrics::HistogramFn for Values {
    fn record(&self, value: f64) {
        self.into.lock().unwrap().push((self.name.clone(), value));
    }
}

impl Histograms {
    pub(crate) fn of(&self, name: &str) -> Vec<f64> {
        let values = self.0.lock().unwrap();
        values
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, v)| *v)
            .collect()
    }
}

impl metrics::Recorder for Histograms {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
        Counter::noop()
    }
    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(Arc::new(Values {
            name: key.name().to_owned(),
            into: self.0.clone(),
        }))
    }
}
