"""What the tests share besides fixtures (those are in tests/conftest.py): the tests' data and
configs (`data`, `runs`), private Ray clusters (`raycluster`) and the two-node one (`netnodes`), a
SeaweedFS S3 server and its fault proxy (`s3server`, `s3proxy`), the nginx image for the Docker
tests (`docker_nginx`), the repository's image and Kubernetes manifests (`image`, `manifests`),
and shards broken on purpose (`shardedit`). Imported by name: `from support.data import tar_keys`
(pytest puts tests/ on sys.path, as the rootdir's conftest.py is there)."""
