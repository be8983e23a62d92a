//! The ResNet family, generic over Burn's `Backend`.

mod block;
mod flavors;
mod resnet;

pub use resnet::{ModelSpec, ResNet};
