package ambientnet

import (
	"os"
	"strings"
	"testing"
	"testing/fstest"
)

func proc(procs map[string][2]string) fstest.MapFS {
	fsys := fstest.MapFS{"self": &fstest.MapFile{Mode: os.ModeDir}}
	for pid, p := range procs {
		fsys[pid+"/comm"] = &fstest.MapFile{Data: []byte(p[0] + "\n")}
		fsys[pid+"/status"] = &fstest.MapFile{Data: []byte("Name:\t" + p[0] + "\nUmask:\t0022\nUid:\t" + p[1] + "\nGid:\t0\t0\t0\t0\n")}
	}
	return fsys
}

func TestKubeletUID(t *testing.T) {
	for _, c := range []struct {
		name  string
		procs map[string][2]string
		want  uint32
		err   string
	}{
		{"kubelet", map[string][2]string{"1": {"systemd", "0\t0\t0\t0"}, "812": {"kubelet", "0\t0\t0\t0"}}, 0, ""},
		{"kubelet as a user, fs uid", map[string][2]string{"812": {"kubelet", "1000\t1000\t1000\t1001"}}, 1001, ""},
		{"microk8s", map[string][2]string{"77": {"kubelite", "0\t0\t0\t0"}}, 0, ""},
		{"k3s server", map[string][2]string{"5": {"k3s-server", "998\t998\t998\t998"}, "6": {"containerd", "0\t0\t0\t0"}}, 998, ""},
		{"k3s agent", map[string][2]string{"5": {"k3s-agent", "997\t997\t997\t997"}}, 997, ""},
		{"kubelet preferred", map[string][2]string{"5": {"k3s", "5\t5\t5\t5"}, "9": {"kubelet", "7\t7\t7\t7"}}, 7, ""},
		{"same name, other uids", map[string][2]string{"5": {"kubelet", "5\t5\t5\t5"}, "9": {"kubelet", "7\t7\t7\t7"}}, 0, "different uids"},
		{"none", map[string][2]string{"5": {"kubeletx", "5\t5\t5\t5"}}, 0, "no kubelet process"},
		{"bad status", map[string][2]string{"5": {"kubelet", "5\t5"}}, 0, "want 4"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := KubeletUID(proc(c.procs))
			switch {
			case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
				t.Fatalf("error %v, want one saying %q", err, c.err)
			case c.err == "" && err != nil:
				t.Fatal(err)
			case c.err == "" && got != c.want:
				t.Fatalf("uid %d, want %d", got, c.want)
			}
		})
	}
	if _, err := KubeletUID(os.DirFS("/proc")); err != nil && !strings.Contains(err.Error(), "no kubelet process") {
		t.Fatalf("the real /proc: %v", err)
	}
}

func TestKubeletNetns(t *testing.T) {
	mk := func(procs map[string][2]string) fstest.MapFS {
		fsys := fstest.MapFS{"self": &fstest.MapFile{Mode: os.ModeDir}}
		for pid, p := range procs {
			fsys[pid+"/comm"] = &fstest.MapFile{Data: []byte(p[0] + "\n")}
			fsys[pid+"/ns/net"] = &fstest.MapFile{Mode: os.ModeSymlink, Data: []byte(p[1])}
		}
		return fsys
	}
	for _, c := range []struct {
		name  string
		procs map[string][2]string
		want  string
		err   string
	}{
		{"kubelet", map[string][2]string{"1": {"systemd", "net:[1]"}, "812": {"kubelet", "net:[2]"}}, "812/ns/net", ""},
		{"kubelet preferred over k3s", map[string][2]string{"5": {"k3s", "net:[1]"}, "9": {"kubelet", "net:[2]"}}, "9/ns/net", ""},
		{"k3s agent", map[string][2]string{"5": {"k3s-agent", "net:[1]"}}, "5/ns/net", ""},
		{"two in one namespace", map[string][2]string{"5": {"kubelet", "net:[3]"}, "6": {"kubelet", "net:[3]"}}, "", ""},
		{"two namespaces", map[string][2]string{"5": {"kubelet", "net:[3]"}, "6": {"kubelet", "net:[4]"}}, "", "different network namespaces"},
		{"none", map[string][2]string{"1": {"systemd", "net:[1]"}}, "", "no kubelet process"},
	} {
		t.Run(c.name, func(t *testing.T) {
			got, err := KubeletNetns(mk(c.procs))
			switch {
			case c.err != "" && (err == nil || !strings.Contains(err.Error(), c.err)):
				t.Fatalf("error %v, want one saying %q", err, c.err)
			case c.err == "" && err != nil:
				t.Fatal(err)
			case c.want != "" && got != c.want:
				t.Fatalf("got %q, want %q", got, c.want)
			case c.err == "" && c.want == "" && got != "5/ns/net" && got != "6/ns/net":
				t.Fatalf("got %q, want one of the kubelets'", got)
			}
		})
	}
}
