//! The ResNet family as data: block kind, stage widths and depths per architecture.

use crate::config::Arch;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    Basic,
    Bottleneck,
}

/// Stage layout of one architecture.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    pub block: BlockKind,
    /// Channels out of the stem.
    pub stem_width: usize,
    /// Per stage: the block width (bottleneck blocks output 4x this).
    pub widths: Vec<usize>,
    /// Per stage: number of blocks. The first block of every stage but the first has stride 2.
    pub depths: Vec<usize>,
}

pub fn layout(arch: Arch) -> Layout {
    let cifar = |n: usize| Layout {
        block: BlockKind::Basic,
        stem_width: 16,
        widths: vec![16, 32, 64],
        depths: vec![n, n, n],
    };
    let imagenet = |block, depths: [usize; 4]| Layout {
        block,
        stem_width: 64,
        widths: vec![64, 128, 256, 512],
        depths: depths.to_vec(),
    };
    match arch {
        Arch::Tiny => Layout {
            block: BlockKind::Basic,
            stem_width: 8,
            widths: vec![8, 16],
            depths: vec![1, 1],
        },
        Arch::Resnet20 => cifar(3),
        Arch::Resnet32 => cifar(5),
        Arch::Resnet56 => cifar(9),
        Arch::Resnet18 => imagenet(BlockKind::Basic, [2, 2, 2, 2]),
        Arch::Resnet34 => imagenet(BlockKind::Basic, [3, 4, 6, 3]),
        Arch::Resnet50 => imagenet(BlockKind::Bottleneck, [3, 4, 6, 3]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_in_the_name_counts_weighted_layers() {
        // Layers with weights: stem conv + convs per block + the classifier.
        for (arch, depth) in [
            (Arch::Resnet20, 20),
            (Arch::Resnet32, 32),
            (Arch::Resnet56, 56),
            (Arch::Resnet18, 18),
            (Arch::Resnet34, 34),
            (Arch::Resnet50, 50),
        ] {
            let l = layout(arch);
            let per_block = match l.block {
                BlockKind::Basic => 2,
                BlockKind::Bottleneck => 3,
            };
            assert_eq!(
                1 + per_block * l.depths.iter().sum::<usize>() + 1,
                depth,
                "{arch:?}"
            );
        }
    }
}
