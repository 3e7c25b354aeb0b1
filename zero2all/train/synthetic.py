from zero2all.data.synthetic import *  # noqa: F401,F403
from zero2all.data.synthetic import SyntheticDataset, SyntheticIterator  # noqa: F401
