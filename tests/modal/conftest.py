from .support import fake_modal, fake_service  # noqa: F401 - fixtures
