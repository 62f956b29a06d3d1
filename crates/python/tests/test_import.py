import kvbridge


def test_version_is_the_crate_version():
    assert kvbridge.__version__.count(".") == 2
