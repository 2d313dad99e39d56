"""The OCI test fixtures (images made by umoci and skopeo, registries on loopback) shared with the template
tests, which convert and boot those images."""

from tests.images.oci.conftest import images, oci_tmp, registry  # noqa: F401  (fixtures)
