"""pytest plugin (`-p shard_plugin --shard i/n`): keep every n-th collected test starting at i, so a slow file run in
a subprocess can be split into parallel tests."""


def pytest_addoption(parser):
    parser.addoption("--shard", default="0/1", help="i/n: run the tests whose collection index is i modulo n")


def pytest_collection_modifyitems(config, items):
    i, n = (int(x) for x in config.getoption("--shard").split("/"))
    items[:] = [item for j, item in enumerate(items) if j % n == i]
