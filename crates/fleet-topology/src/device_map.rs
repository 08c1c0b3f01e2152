//! Where each block of a decoder model lives.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::TopologyError;

/// One device: the host CPU or a CUDA GPU by its index (after `CUDA_VISIBLE_DEVICES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum DeviceLocation {
    /// The host.
    Cpu,
    /// CUDA GPU `n`.
    Cuda(usize),
}

impl DeviceLocation {
    /// The GPU index, or `None` for the CPU.
    pub fn cuda_ordinal(self) -> Option<usize> {
        match self {
            DeviceLocation::Cuda(n) => Some(n),
            DeviceLocation::Cpu => None,
        }
    }
}

impl fmt::Display for DeviceLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceLocation::Cpu => write!(f, "cpu"),
            DeviceLocation::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for DeviceLocation {
    type Err = TopologyError;

    /// Parses `cpu`, `cuda` (GPU 0), `cuda:N` or a bare GPU index `N`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase();
        let bad = || TopologyError::BadDevice {
            value: s.to_string(),
        };
        match t.as_str() {
            "cpu" => Ok(DeviceLocation::Cpu),
            "cuda" | "gpu" => Ok(DeviceLocation::Cuda(0)),
            _ => {
                let n = t
                    .strip_prefix("cuda:")
                    .or_else(|| t.strip_prefix("gpu:"))
                    .unwrap_or(&t);
                n.parse::<usize>()
                    .map(DeviceLocation::Cuda)
                    .map_err(|_| bad())
            }
        }
    }
}

impl From<DeviceLocation> for String {
    fn from(d: DeviceLocation) -> String {
        d.to_string()
    }
}

impl TryFrom<String> for DeviceLocation {
    type Error = TopologyError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// The device of every block of a decoder: the token embedding, each decoder layer, and the
/// final norm with the lm_head.
///
/// Hidden states move between devices only where consecutive blocks differ. When the embedding
/// and lm_head weights are tied, the loader keeps a copy of the shared matrix on the head's
/// device if it differs from the embedding's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMap {
    /// Device of the token embedding.
    pub embed: DeviceLocation,
    /// Device of each decoder layer, in order.
    pub layers: Vec<DeviceLocation>,
    /// Device of the final norm and the lm_head.
    pub head: DeviceLocation,
}

impl DeviceMap {
    /// Everything on one device.
    pub fn single(device: DeviceLocation, num_layers: usize) -> Self {
        DeviceMap {
            embed: device,
            layers: vec![device; num_layers],
            head: device,
        }
    }

    /// Contiguous, near-equal layer ranges over `devices` in order; the embedding goes with the
    /// first range, the final norm and lm_head with the last. Earlier groups get the extra layer
    /// when the count does not divide evenly.
    pub fn split_layers(
        devices: &[DeviceLocation],
        num_layers: usize,
    ) -> Result<Self, TopologyError> {
        let groups = devices.len();
        if groups == 0 {
            return Err(TopologyError::NoDevices);
        }
        if groups > num_layers.max(1) {
            return Err(TopologyError::TooManyGroups {
                layers: num_layers,
                groups,
            });
        }
        let mut layers = Vec::with_capacity(num_layers);
        for (g, &dev) in devices.iter().enumerate() {
            let n = num_layers / groups + usize::from(g < num_layers % groups);
            layers.extend(std::iter::repeat_n(dev, n));
        }
        Ok(DeviceMap {
            embed: devices[0],
            layers,
            head: devices[groups - 1],
        })
    }

    /// Checks that the map names exactly `num_layers` layers.
    pub fn validate(&self, num_layers: usize) -> Result<(), TopologyError> {
        if self.layers.len() != num_layers {
            return Err(TopologyError::LayerCountMismatch {
                got: self.layers.len(),
                expected: num_layers,
            });
        }
        Ok(())
    }

    /// The distinct devices in first-use order (embedding, layers, head).
    pub fn devices(&self) -> Vec<DeviceLocation> {
        let mut out = Vec::new();
        for d in std::iter::once(self.embed)
            .chain(self.layers.iter().copied())
            .chain(std::iter::once(self.head))
        {
            if !out.contains(&d) {
                out.push(d);
            }
        }
        out
    }

    /// Number of places where the hidden state crosses from one device to another.
    pub fn boundaries(&self) -> usize {
        let seq: Vec<_> = std::iter::once(self.embed)
            .chain(self.layers.iter().copied())
            .chain(std::iter::once(self.head))
            .collect();
        seq.windows(2).filter(|w| w[0] != w[1]).count()
    }
}

impl fmt::Display for DeviceMap {
    /// A compact form: `embed=cuda:0 layers[0..14]=cuda:0 layers[14..28]=cuda:1 head=cuda:1`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "embed={}", self.embed)?;
        let mut start = 0;
        while start < self.layers.len() {
            let dev = self.layers[start];
            let end = start
                + self.layers[start..]
                    .iter()
                    .take_while(|&&d| d == dev)
                    .count();
            write!(f, " layers[{start}..{end}]={dev}")?;
            start = end;
        }
        write!(f, " head={}", self.head)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_devices() {
        assert_eq!(
            "cpu".parse::<DeviceLocation>().unwrap(),
            DeviceLocation::Cpu
        );
        assert_eq!(
            "cuda".parse::<DeviceLocation>().unwrap(),
            DeviceLocation::Cuda(0)
        );
        assert_eq!(
            "cuda:3".parse::<DeviceLocation>().unwrap(),
            DeviceLocation::Cuda(3)
        );
        assert_eq!(
            "2".parse::<DeviceLocation>().unwrap(),
            DeviceLocation::Cuda(2)
        );
        let err = "tpu:1".parse::<DeviceLocation>().unwrap_err().to_string();
        assert!(err.contains("tpu:1") && err.contains("cuda:N"), "{err}");
    }

    #[test]
    fn splits_layers_contiguously() {
        let devs = [
            DeviceLocation::Cuda(0),
            DeviceLocation::Cuda(1),
            DeviceLocation::Cuda(2),
        ];
        let map = DeviceMap::split_layers(&devs, 7).unwrap();
        assert_eq!(
            map.layers,
            vec![
                DeviceLocation::Cuda(0),
                DeviceLocation::Cuda(0),
                DeviceLocation::Cuda(0),
                DeviceLocation::Cuda(1),
                DeviceLocation::Cuda(1),
                DeviceLocation::Cuda(2),
                DeviceLocation::Cuda(2)
            ]
        );
        assert_eq!(map.embed, DeviceLocation::Cuda(0));
        assert_eq!(map.head, DeviceLocation::Cuda(2));
        assert_eq!(map.boundaries(), 2);
        assert_eq!(map.devices().len(), 3);
        assert_eq!(
            map.to_string(),
            "embed=cuda:0 layers[0..3]=cuda:0 layers[3..5]=cuda:1 layers[5..7]=cuda:2 head=cuda:2"
        );
    }

    #[test]
    fn rejects_bad_splits() {
        assert!(matches!(
            DeviceMap::split_layers(&[], 4),
            Err(TopologyError::NoDevices)
        ));
        let devs = vec![DeviceLocation::Cpu; 5];
        assert!(matches!(
            DeviceMap::split_layers(&devs, 4),
            Err(TopologyError::TooManyGroups { .. })
        ));
        let map = DeviceMap::single(DeviceLocation::Cpu, 3);
        assert!(map.validate(4).is_err());
        assert!(map.validate(3).is_ok());
        assert_eq!(map.boundaries(), 0);
    }

    #[test]
    fn serializes_as_strings() {
        let map =
            DeviceMap::split_layers(&[DeviceLocation::Cpu, DeviceLocation::Cuda(1)], 2).unwrap();
        let json = serde_json::to_string(&map).unwrap();
        assert_eq!(
            json,
            r#"{"embed":"cpu","layers":["cpu","cuda:1"],"head":"cuda:1"}"#
        );
        let back: DeviceMap = serde_json::from_str(&json).unwrap();
        assert_eq!(back, map);
    }
}
