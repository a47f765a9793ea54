"""The package list, which pyproject.toml cannot state: kernels/ installs as ``arbor_kernels``.

The folder keeps the layout's name; the import name is the project's own, because ``kernels`` is
also the name of Hugging Face's package, which transformers imports (docs/architecture.md,
"Import names"). Everything else about the build is in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

_TOP_LEVEL = ["runtime", "radix_cache", "grammar", "frontend_lang", "lazy_exports"]
_RENAMED = {"kernels": "arbor_kernels"}


def _packages() -> list[str]:
    found = find_namespace_packages(
        include=[f"{name}*" for name in [*_TOP_LEVEL, *_RENAMED]], exclude=["*__pycache__"]
    )
    packages = []
    for name in found:
        top, _, rest = name.partition(".")
        if top not in _TOP_LEVEL and top not in _RENAMED:
            continue
        top = _RENAMED.get(top, top)
        packages.append(f"{top}.{rest}" if rest else top)
    return sorted(packages)


setup(packages=_packages())
