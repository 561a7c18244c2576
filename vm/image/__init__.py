"""The guest image build: `build_image` turns the recipe (`images/guest/`) into `<data_dir>/images/<name>/`.

Modules: `build` (the build and its manifest: `build_image`, `BuildOptions`, `BuildEnv`, `Reporter`), `recipe`
(the recipe and the pure parts of a build: stage keys, which stages must run), `stages` (each stage and the cache
that keeps its output), `system` (commands, chroots, tarballs, the vmlinux inside a bzImage), `prereq` (what the
build machine must have first). May import: `vm.image.*` only; nothing else of `vm`, never `server` or `proxy`.
"""

from wakeful.vm.image.build import (
    DEFAULT_RECIPE,
    MANIFEST_FORMAT,
    BuildEnv,
    BuildOptions,
    BuildResult,
    PrerequisitesMissing,
    Reporter,
    build_image,
    image_checksum,
    make_manifest,
)
from wakeful.vm.image.recipe import ImageError, Stage

__all__ = [
    "DEFAULT_RECIPE",
    "MANIFEST_FORMAT",
    "BuildEnv",
    "BuildOptions",
    "BuildResult",
    "ImageError",
    "PrerequisitesMissing",
    "Reporter",
    "Stage",
    "build_image",
    "image_checksum",
    "make_manifest",
]
